import {
  TimeChart,
  linePath,
  niceTicks,
  timeLabel,
  timeTicks
} from '../src/chart';

describe('chart axes', () => {
  it('has round y ticks up to at least the maximum', () => {
    expect(niceTicks(100)).toEqual([0, 25, 50, 75, 100]);
    expect(niceTicks(79.6)).toEqual([0, 20, 40, 60, 80]);
    expect(niceTicks(79.6, 1)).toEqual([0, 100]);
  });

  it('labels the time axis back from now, fewer labels when narrow', () => {
    expect(timeTicks(120_000).map(timeLabel)).toEqual([
      'now',
      '−30 s',
      '−1 min',
      '−90 s',
      '−2 min'
    ]);
    expect(timeTicks(300_000, 3).map(timeLabel)).toEqual([
      'now',
      '−2 min',
      '−4 min'
    ]);
  });

  it('leaves gaps where a value is missing', () => {
    const points = [
      { time: 0, value: 1 },
      { time: 1, value: null },
      { time: 2, value: 3 },
      { time: 3, value: 4 }
    ];
    expect(
      linePath(
        points,
        t => t * 10,
        v => v
      )
    ).toBe('M0.0,1.0M20.0,3.0L30.0,4.0');
  });
});

describe('TimeChart', () => {
  it('draws labelled axes, a legend and a tooltip', () => {
    const chart = new TimeChart({ title: 'Utilisation', unit: '%' });
    document.body.appendChild(chart.node);
    chart.update({
      series: [
        {
          label: 'GPU busy',
          kind: 'utilization',
          points: [{ time: 1000, value: 40 }]
        }
      ],
      yMax: 100,
      windowMs: 120_000,
      now: 1000,
      format: v => `${v} %`
    });
    const texts = Array.from(chart.node.querySelectorAll('svg text')).map(
      t => t.textContent
    );
    expect(texts).toEqual(
      expect.arrayContaining(['0', '100', 'now', '−2 min'])
    );
    expect(chart.node.textContent).toContain('Utilisation (%)');
    expect(chart.node.querySelector('ul')!.textContent).toBe('GPU busy');
    expect(chart.node.querySelector('svg')!.getAttribute('aria-label')).toBe(
      'Utilisation, last 2 min: GPU busy 40 %'
    );
    chart.hover(900);
    const tooltip = chart.node.querySelector<HTMLElement>(
      '.jp-GpuHotplug-chart-tooltip'
    )!;
    expect(tooltip.hidden).toBe(false);
    expect(tooltip.textContent).toBe('now\nGPU busy: 40 %');
    chart.hover(null);
    expect(tooltip.hidden).toBe(true);
  });
});
