/**
 * The panel's charts as CSV: what the charts show (the chosen window of every
 * GPU's readings), for a spreadsheet or a report — what users otherwise
 * copied out of nvdashboard. Pure: the panel turns the text into a download.
 */
import { ISample } from './gpuModel';
import { INodeGpu } from './types';

/** The header row, in the units the charts use. */
export const CSV_HEADER =
  'time_utc,gpu_index,gpu_uuid,utilization_percent,memory_bandwidth_percent,memory_used_bytes,memory_total_bytes,' +
  'pcie_tx_bytes_per_second,pcie_rx_bytes_per_second,nvlink_tx_bytes_per_second,nvlink_rx_bytes_per_second';

function cell(value: number | null): string {
  return value === null ? '' : String(value);
}

/**
 * One row per reading of each GPU within `windowMs` before `now` (ms since
 * the epoch), GPUs in the node's order, readings oldest first; an empty cell
 * where NVML gave nothing.
 */
export function chartsCsv(
  gpus: readonly INodeGpu[],
  history: ReadonlyMap<string, readonly ISample[]>,
  windowMs: number,
  now: number
): string {
  const since = now - windowMs;
  const rows = [CSV_HEADER];
  for (const gpu of [...gpus].sort((a, b) => a.index - b.index)) {
    for (const sample of history.get(gpu.uuid) ?? []) {
      if (sample.time < since || sample.time > now) {
        continue;
      }
      rows.push(
        [
          new Date(sample.time).toISOString(),
          gpu.index,
          gpu.uuid,
          cell(sample.utilization),
          cell(sample.memoryActivity),
          cell(sample.memoryUsed),
          cell(sample.memoryTotal),
          cell(sample.pcieTx),
          cell(sample.pcieRx),
          cell(sample.nvlinkTx),
          cell(sample.nvlinkRx)
        ].join(',')
      );
    }
  }
  return rows.join('\n') + '\n';
}

/** "gpu-charts-2026-11-28T12-31-05Z.csv": a file name that sorts by time. */
export function csvFileName(now: number): string {
  const stamp = new Date(now).toISOString().replace(/\.\d+Z$/, 'Z');
  return `gpu-charts-${stamp.replace(/:/g, '-')}.csv`;
}
