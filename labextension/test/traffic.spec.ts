import { ISample } from '../src/gpuModel';
import { TRAFFIC_LINKS, TrafficCharts, trafficData } from '../src/traffic';
import { trans } from './fixtures';

const [PCIE, NVLINK] = TRAFFIC_LINKS;
const WINDOW = { windowMs: 60_000, now: 60_000 };

const sample = (
  time: number,
  pcie: number | null,
  nvlink: number | null
): ISample => ({
  time,
  utilization: 50,
  memoryActivity: 10,
  memoryUsed: 1,
  memoryTotal: 2,
  pcieTx: pcie === null ? null : pcie / 4,
  pcieRx: pcie,
  nvlinkTx: nvlink,
  nvlinkRx: nvlink
});

describe('the traffic charts (issue 36)', () => {
  it('draw sent and received in the unit the largest value reaches', () => {
    const data = trafficData(
      PCIE,
      [sample(1000, 8e9, null), sample(2000, 12e9, null)],
      WINDOW,
      trans
    )!;
    expect(data.unit).toBe('GB/s');
    expect(data.yMax).toBe(12);
    expect(data.series.map(s => [s.label, s.kind])).toEqual([
      ['received', 'rx'],
      ['sent', 'tx']
    ]);
    expect(data.series[1].points.map(p => p.value)).toEqual([2, 3]);
    expect(data.format(12)).toBe('12 GB/s');
  });

  it('leave NVLink out where NVML gives none (null, not 0)', () => {
    const samples = [sample(1000, 0, null), sample(2000, 0, null)];
    expect(trafficData(NVLINK, samples, WINDOW, trans)).toBeNull();
    expect(trafficData(PCIE, samples, WINDOW, trans)?.unit).toBe('B/s');

    const charts = new TrafficCharts(trans, () => undefined);
    charts.update(samples, WINDOW);
    expect(
      charts.charts.map(c => [c.node.dataset.chart, c.node.hidden])
    ).toEqual([
      ['pcie', false],
      ['nvlink', true]
    ]);
    charts.update([sample(1000, 5e6, null), sample(2000, 5e6, 3e11)], WINDOW);
    expect(charts.charts[1].node.hidden).toBe(false);
    expect(charts.charts[1].node.textContent).toContain('NVLink (GB/s)');
    charts.dispose();
  });
});
