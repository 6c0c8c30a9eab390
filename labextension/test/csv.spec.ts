import { CSV_HEADER, chartsCsv, csvFileName } from '../src/csv';
import { ISample } from '../src/gpuModel';
import { INodeGpu } from '../src/types';

const node = (index: number): INodeGpu => ({
  uuid: `GPU-${index}`,
  index,
  minor: index,
  name: 'H100',
  memory_total: 80,
  state: 'free',
  mine: false
});

const sample = (time: number, utilization: number | null): ISample => ({
  time,
  utilization,
  memoryActivity: 5,
  memoryUsed: 1024,
  memoryTotal: 2048,
  pcieTx: 1000,
  pcieRx: 3000,
  nvlinkTx: null,
  nvlinkRx: null
});

describe('CSV export of the charts (issue 36)', () => {
  it('has one row per reading in the window, GPUs in node order', () => {
    const now = Date.UTC(2026, 10, 28, 12, 0, 0);
    const history = new Map([
      ['GPU-1', [sample(now - 1000, 40)]],
      ['GPU-0', [sample(now - 200_000, 1), sample(now - 2000, null)]]
    ]);
    expect(
      chartsCsv([node(1), node(0)], history, 120_000, now).split('\n')
    ).toEqual([
      CSV_HEADER,
      '2026-11-28T11:59:58.000Z,0,GPU-0,,5,1024,2048,1000,3000,,',
      '2026-11-28T11:59:59.000Z,1,GPU-1,40,5,1024,2048,1000,3000,,',
      ''
    ]);
  });

  it('names the file after the time', () => {
    expect(csvFileName(Date.UTC(2026, 10, 28, 12, 31, 5, 120))).toBe(
      'gpu-charts-2026-11-28T12-31-05Z.csv'
    );
  });
});
