/**
 * A hand-drawn SVG line chart of a GPU's utilisation and memory (percent over
 * the last samples). Smaller than any chart library and styled only with
 * JupyterLab's theme variables (see `style/base.css`), so light and dark
 * themes need nothing of their own.
 */
import { Classes } from './constants';
import { ISample } from './gpuModel';

const SVG_NS = 'http://www.w3.org/2000/svg';
const WIDTH = 240;
const HEIGHT = 48;

/** The `points` of a polyline through `values` (0–100), `slots` wide. */
export function polylinePoints(
  values: readonly (number | null)[],
  slots: number
): string {
  const step = WIDTH / Math.max(1, slots - 1);
  const offset = slots - values.length;
  const points: string[] = [];
  values.forEach((value, i) => {
    if (value === null) {
      return;
    }
    const clamped = Math.max(0, Math.min(100, value));
    const x = (offset + i) * step;
    const y = HEIGHT - (clamped / 100) * HEIGHT;
    points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
  });
  return points.join(' ');
}

/** An SVG chart of `samples` with an accessible summary `label`. */
export function renderChart(
  samples: readonly ISample[],
  slots: number,
  label: string
): SVGSVGElement {
  const svg = document.createElementNS(SVG_NS, 'svg');
  svg.setAttribute('class', Classes.chart);
  svg.setAttribute('viewBox', `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', label);
  const title = document.createElementNS(SVG_NS, 'title');
  title.textContent = label;
  svg.appendChild(title);
  for (const [kind, values] of [
    ['utilization', samples.map(s => s.utilization)],
    ['memory', samples.map(s => s.memory)]
  ] as const) {
    const line = document.createElementNS(SVG_NS, 'polyline');
    line.setAttribute('class', `${Classes.chart}-${kind}`);
    line.setAttribute('points', polylinePoints(values, slots));
    svg.appendChild(line);
  }
  return svg;
}
