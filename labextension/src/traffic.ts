/**
 * A GPU's traffic charts: PCIe (sent and received) and NVLink (over all its
 * links), the two nvdashboard users look for besides utilisation and memory.
 * A module of its own so the panel only places them: it hands in the GPU's
 * samples of the shown window and the hover of its sibling charts.
 *
 * Each chart is shown only while it has something to show: NVML gives NVLink
 * traffic only on GPUs with NVLinks (`null` elsewhere, never 0), and an older
 * server sends no traffic at all. Rates span bytes to hundreds of GB/s, so the
 * y axis counts in the unit the window's largest value reaches.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { IChartData, ISeries, TimeChart } from './chart';
import { bytesPerSecond, rateUnit } from './format';
import { ISample } from './gpuModel';

/** Which traffic a chart shows: the sample's members for sent and received. */
export interface ILink {
  name: 'pcie' | 'nvlink';
  tx: (sample: ISample) => number | null;
  rx: (sample: ISample) => number | null;
}

export const TRAFFIC_LINKS: readonly ILink[] = [
  { name: 'pcie', tx: s => s.pcieTx, rx: s => s.pcieRx },
  { name: 'nvlink', tx: s => s.nvlinkTx, rx: s => s.nvlinkRx }
];

/**
 * What one traffic chart draws from `samples` (`null`: nothing to show, the
 * chart is hidden): TX and RX lines in the unit the largest value reaches.
 */
export function trafficData(
  link: ILink,
  samples: readonly ISample[],
  window: { windowMs: number; now: number },
  trans: TranslationBundle
): IChartData | null {
  const values = samples.flatMap(s => [link.tx(s), link.rx(s)]);
  const known = values.filter((v): v is number => v !== null);
  if (known.length === 0) {
    return null;
  }
  const { unit, size } = rateUnit(Math.max(...known));
  const series = (
    label: string,
    kind: string,
    read: (sample: ISample) => number | null
  ): ISeries => ({
    label,
    kind,
    points: samples.map(s => {
      const value = read(s);
      return { time: s.time, value: value === null ? null : value / size };
    })
  });
  return {
    series: [
      series(trans.__('received'), 'rx', link.rx),
      series(trans.__('sent'), 'tx', link.tx)
    ],
    yMax: Math.max(...known) / size,
    windowMs: window.windowMs,
    now: window.now,
    format: value => bytesPerSecond(value * size),
    unit
  };
}

/** The PCIe and NVLink charts of one GPU. */
export class TrafficCharts {
  constructor(
    trans: TranslationBundle,
    onHover: (time: number | null) => void
  ) {
    this._trans = trans;
    const titles = { pcie: trans.__('PCIe'), nvlink: trans.__('NVLink') };
    this.charts = TRAFFIC_LINKS.map(link => {
      const chart = new TimeChart({
        title: titles[link.name],
        unit: 'B/s',
        onHover
      });
      chart.node.dataset.chart = link.name;
      chart.node.hidden = true;
      return chart;
    });
  }

  /** PCIe, then NVLink. */
  readonly charts: readonly TimeChart[];

  /** Draw the window's `samples` (already cut to the window). */
  update(
    samples: readonly ISample[],
    window: { windowMs: number; now: number }
  ): void {
    TRAFFIC_LINKS.forEach((link, at) => {
      const chart = this.charts[at];
      const data = trafficData(link, samples, window, this._trans);
      chart.node.hidden = data === null;
      if (data !== null) {
        chart.update(data);
      }
    });
  }

  dispose(): void {
    for (const chart of this.charts) {
      chart.dispose();
    }
  }

  private readonly _trans: TranslationBundle;
}
