/**
 * A time chart drawn as SVG: a y axis with gridlines and units, a time axis
 * ("−2 min" … "now"), a legend, and a hover tooltip with the values nearest
 * the pointer. It draws at the pixel size of its container (text never
 * stretches) and redraws when the container is resized, so its height follows
 * the panel's.
 *
 * Why hand-drawn rather than a chart library: the candidates that fit a
 * JupyterLab side panel (uPlot ≈ 50 KB minified, Chart.js ≈ 200 KB, Vega far
 * more) draw on a canvas, where JupyterLab's theme variables do not reach: a
 * theme switch means reading computed styles and redrawing by hand. This SVG
 * is styled by CSS classes only (`style/base.css`, theme variables), so light
 * and dark themes need nothing, screen readers get real text, and the whole
 * module is a few KB. What it draws is small: two or three series of at most
 * 300 points (5 minutes at one reading a second).
 */
import { Classes } from './constants';

const SVG_NS = 'http://www.w3.org/2000/svg';

/** Space for the axes' labels, in pixels. */
const MARGIN = { left: 30, right: 10, top: 6, bottom: 18 };

/**
 * Least room between two labels of an axis, in pixels: a time label ("−2 min")
 * is about 37 px wide, so 72 leaves a clear gap (56 read as crowded).
 */
const LABEL_SPACING = { x: 72, y: 20 };

/** Charts never draw smaller than this (a collapsed panel). */
const MIN_WIDTH = 120;
const MIN_HEIGHT = 60;

/** One line of a chart. */
export interface ISeries {
  /** The legend's words ("GPU", "used"). */
  label: string;
  /** Suffix of its CSS class (`jp-GpuHotplug-chart-<kind>`), which styles it. */
  kind: string;
  /** Points in time order; `null` values leave a gap. */
  points: readonly { time: number; value: number | null }[];
}

/** What to draw. */
export interface IChartData {
  series: readonly ISeries[];
  /** The y axis goes from 0 to this. */
  yMax: number;
  /** The visible time span ending at `now`, in milliseconds. */
  windowMs: number;
  now: number;
  /** How a value reads in the tooltip ("37 %", "12 GiB"). */
  format: (value: number) => string;
  /** The y axis's unit now, for a chart whose unit follows its values ("MB/s"). */
  unit?: string;
}

/** Up to `count` + 1 round steps from 0 to at least `max` (0, 20, 40…). */
export function niceTicks(max: number, count = 4): number[] {
  if (!(max > 0)) {
    return [0, 1];
  }
  const raw = max / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step =
    [1, 2, 2.5, 5, 10].map(f => f * power).find(s => s >= raw) ?? raw;
  const ticks: number[] = [];
  for (let value = 0; value < max + step / 2; value += step) {
    ticks.push(Number(value.toPrecision(6)));
  }
  return ticks;
}

/**
 * Time-axis ticks, as offsets before now in ms: every 30 s, minute or two,
 * whichever leaves `maxTicks` + 1 labels or fewer.
 */
export function timeTicks(windowMs: number, maxTicks = 4): number[] {
  const step =
    [30_000, 60_000, 120_000, 300_000].find(s => windowMs / s <= maxTicks) ??
    windowMs;
  const ticks: number[] = [];
  for (let offset = 0; offset <= windowMs; offset += step) {
    ticks.push(offset);
  }
  return ticks;
}

/** "now", "−30 s", "−2 min". */
export function timeLabel(offsetMs: number): string {
  if (offsetMs === 0) {
    return 'now';
  }
  const seconds = Math.round(offsetMs / 1000);
  return seconds % 60 === 0 ? `−${seconds / 60} min` : `−${seconds} s`;
}

/** The SVG path of `points` in a `width`×`height` plot (gaps start a new segment). */
export function linePath(
  points: ISeries['points'],
  x: (time: number) => number,
  y: (value: number) => number
): string {
  let path = '';
  let drawing = false;
  for (const point of points) {
    if (point.value === null) {
      drawing = false;
      continue;
    }
    path += `${drawing ? 'L' : 'M'}${x(point.time).toFixed(1)},${y(point.value).toFixed(1)}`;
    drawing = true;
  }
  return path;
}

function svg<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attributes: Record<string, string | number> = {},
  text?: string
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) {
    node.setAttribute(name, String(value));
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/**
 * One chart: `node` holds the SVG, its legend and its tooltip. `update()`
 * gives it new data; it redraws itself when its box changes size. `hover`
 * mirrors the pointer's time from a sibling chart (synced tooltips).
 */
export class TimeChart {
  constructor(options: {
    /** The chart's name, also its accessible name prefix ("Utilisation"). */
    title: string;
    /** What the y axis counts in ("%", "GiB"): shown after the title. */
    unit: string;
    /** Called with the time under the pointer (`null`: it left). */
    onHover?: (time: number | null) => void;
  }) {
    this._title = options.title;
    this._onHover = options.onHover ?? (() => undefined);
    this.node = document.createElement('div');
    this.node.className = Classes.chart;
    this._svg = svg('svg', { role: 'img' });
    this._svg.classList.add(`${Classes.chart}-svg`);
    this._legend = document.createElement('ul');
    this._legend.className = `${Classes.chart}-legend`;
    this._legend.setAttribute('aria-label', `${this._title}: legend`);
    this._tooltip = document.createElement('div');
    this._tooltip.className = `${Classes.chart}-tooltip`;
    this._tooltip.hidden = true;
    const plot = document.createElement('div');
    plot.className = `${Classes.chart}-plot`;
    plot.append(this._svg, this._tooltip);
    this._plot = plot;
    const heading = document.createElement('div');
    heading.className = `${Classes.chart}-title`;
    heading.textContent = `${options.title} (${options.unit})`;
    heading.setAttribute('aria-hidden', 'true');
    this._heading = heading;
    this.node.append(heading, plot, this._legend);
    this._svg.addEventListener('mousemove', event => {
      const box = this._svg.getBoundingClientRect();
      const time = this._timeAt(event.clientX - box.left);
      this.hover(time);
      this._onHover(time);
    });
    this._svg.addEventListener('mouseleave', () => {
      this.hover(null);
      this._onHover(null);
    });
    if (typeof ResizeObserver !== 'undefined') {
      this._resize = new ResizeObserver(() => this._draw());
      this._resize.observe(plot);
    }
  }

  readonly node: HTMLDivElement;

  /** New data: redraws the chart and the legend. */
  update(data: IChartData): void {
    this._data = data;
    if (data.unit !== undefined) {
      this._heading.textContent = `${this._title} (${data.unit})`;
    }
    this._drawLegend();
    this._draw();
  }

  /** Show the tooltip at `time` (or hide it). */
  hover(time: number | null): void {
    this._hovered = time;
    this._drawHover();
  }

  dispose(): void {
    this._resize?.disconnect();
  }

  private _size(): { width: number; height: number } {
    return {
      width: Math.max(MIN_WIDTH, this._plot.clientWidth),
      height: Math.max(MIN_HEIGHT, this._plot.clientHeight)
    };
  }

  private _scales() {
    const data = this._data;
    const { width, height } = this._size();
    const plotWidth = width - MARGIN.left - MARGIN.right;
    const plotHeight = height - MARGIN.top - MARGIN.bottom;
    const start = (data?.now ?? 0) - (data?.windowMs ?? 1);
    const x = (time: number) =>
      MARGIN.left + ((time - start) / (data?.windowMs ?? 1)) * plotWidth;
    const yCount = Math.max(1, Math.floor(plotHeight / LABEL_SPACING.y));
    const yTicks = niceTicks(data?.yMax || 1, Math.min(4, yCount));
    const yMax = yTicks[yTicks.length - 1];
    const y = (value: number) =>
      MARGIN.top +
      plotHeight -
      (Math.max(0, Math.min(yMax, value)) / yMax) * plotHeight;
    return { width, height, plotWidth, start, x, y, yTicks };
  }

  private _timeAt(px: number): number | null {
    const data = this._data;
    if (data === null) {
      return null;
    }
    const { plotWidth, start } = this._scales();
    const fraction = (px - MARGIN.left) / plotWidth;
    if (fraction < 0 || fraction > 1) {
      return null;
    }
    return start + fraction * data.windowMs;
  }

  private _draw(): void {
    const data = this._data;
    if (data === null) {
      return;
    }
    const { width, height, plotWidth, x, y, yTicks } = this._scales();
    const root = this._svg;
    root.setAttribute('width', String(width));
    root.setAttribute('height', String(height));
    root.setAttribute('viewBox', `0 0 ${width} ${height}`);
    const summary = data.series
      .map(series => {
        const last = [...series.points].reverse().find(p => p.value !== null);
        return `${series.label} ${last?.value == null ? 'unknown' : data.format(last.value)}`;
      })
      .join(', ');
    root.setAttribute(
      'aria-label',
      `${this._title}, last ${timeLabel(data.windowMs).slice(1)}: ${summary}`
    );
    const children: SVGElement[] = [
      svg('title', {}, `${this._title}: ${summary}`)
    ];

    const yAxis = svg('g', {
      class: `${Classes.chart}-axis ${Classes.chart}-y`
    });
    for (const tick of yTicks) {
      const at = y(tick);
      yAxis.append(
        svg('line', {
          class: `${Classes.chart}-grid`,
          x1: MARGIN.left,
          x2: MARGIN.left + plotWidth,
          y1: at,
          y2: at
        }),
        svg(
          'text',
          { x: MARGIN.left - 4, y: at + 3, 'text-anchor': 'end' },
          String(tick)
        )
      );
    }
    const xAxis = svg('g', {
      class: `${Classes.chart}-axis ${Classes.chart}-x`
    });
    const xCount = Math.max(1, Math.floor(plotWidth / LABEL_SPACING.x));
    for (const offset of timeTicks(data.windowMs, xCount)) {
      const at = x(data.now - offset);
      xAxis.append(
        svg('line', {
          class: `${Classes.chart}-tick`,
          x1: at,
          x2: at,
          y1: height - MARGIN.bottom,
          y2: height - MARGIN.bottom + 3
        }),
        svg(
          'text',
          {
            x: at,
            y: height - 5,
            'text-anchor':
              offset === 0
                ? 'end'
                : offset === data.windowMs
                  ? 'start'
                  : 'middle'
          },
          timeLabel(offset)
        )
      );
    }
    xAxis.append(
      svg('line', {
        class: `${Classes.chart}-baseline`,
        x1: MARGIN.left,
        x2: MARGIN.left + plotWidth,
        y1: height - MARGIN.bottom,
        y2: height - MARGIN.bottom
      })
    );
    children.push(yAxis, xAxis);

    const clipId = `${Classes.chart}-clip-${this._id}`;
    const clip = svg('clipPath', { id: clipId });
    clip.append(
      svg('rect', {
        x: MARGIN.left,
        y: 0,
        width: plotWidth,
        height
      })
    );
    const lines = svg('g', { 'clip-path': `url(#${clipId})` });
    for (const series of data.series) {
      lines.append(
        svg('path', {
          class: `${Classes.chart}-line ${Classes.chart}-${series.kind}`,
          d: linePath(series.points, x, y)
        })
      );
    }
    this._cursor = svg('line', {
      class: `${Classes.chart}-cursor`,
      y1: MARGIN.top,
      y2: height - MARGIN.bottom
    });
    children.push(clip, lines, this._cursor);
    root.replaceChildren(...children);
    this._drawHover();
  }

  private _drawLegend(): void {
    const data = this._data;
    if (data === null) {
      return;
    }
    const labels = data.series.map(series => `${series.kind}:${series.label}`);
    if (labels.join('|') === this._legendKey) {
      return;
    }
    this._legendKey = labels.join('|');
    const items = data.series.map(series => {
      const item = document.createElement('li');
      const swatch = svg('svg', {
        width: 18,
        height: 8,
        'aria-hidden': 'true'
      });
      swatch.append(
        svg('line', {
          class: `${Classes.chart}-line ${Classes.chart}-${series.kind}`,
          x1: 0,
          x2: 18,
          y1: 4,
          y2: 4
        })
      );
      item.append(swatch, document.createTextNode(series.label));
      return item;
    });
    this._legend.replaceChildren(...items);
  }

  private _drawHover(): void {
    const data = this._data;
    const time = this._hovered;
    if (data === null || time === null || this._cursor === null) {
      this._tooltip.hidden = true;
      this._cursor?.setAttribute('visibility', 'hidden');
      return;
    }
    const { x, width } = this._scales();
    const lines = data.series.map(series => {
      let nearest: { time: number; value: number | null } | null = null;
      for (const point of series.points) {
        if (
          nearest === null ||
          Math.abs(point.time - time) < Math.abs(nearest.time - time)
        ) {
          nearest = point;
        }
      }
      return { series, nearest };
    });
    const at = lines.find(line => line.nearest !== null)?.nearest?.time ?? time;
    const px = x(at);
    this._cursor.setAttribute('x1', String(px));
    this._cursor.setAttribute('x2', String(px));
    this._cursor.setAttribute('visibility', 'visible');
    const rows = [
      timeLabel(Math.max(0, Math.round((data.now - at) / 1000) * 1000))
    ];
    for (const { series, nearest } of lines) {
      rows.push(
        `${series.label}: ${nearest?.value == null ? '–' : data.format(nearest.value)}`
      );
    }
    this._tooltip.textContent = rows.join('\n');
    this._tooltip.hidden = false;
    const left = px + 8 > width - 120 ? px - 128 : px + 8;
    this._tooltip.style.left = `${Math.max(0, left)}px`;
  }

  private readonly _title: string;
  private readonly _onHover: (time: number | null) => void;
  private readonly _svg: SVGSVGElement;
  private readonly _heading: HTMLDivElement;
  private readonly _plot: HTMLDivElement;
  private readonly _legend: HTMLUListElement;
  private readonly _tooltip: HTMLDivElement;
  private readonly _resize: ResizeObserver | null = null;
  private readonly _id = (TimeChart._count += 1);
  private _cursor: SVGLineElement | null = null;
  private _data: IChartData | null = null;
  private _hovered: number | null = null;
  private _legendKey = '';

  private static _count = 0;
}
