/**
 * How every view words and numbers a GPU: one numbering (the node's index, as
 * `nvidia-smi` on the host shows it, with the kernel's own CUDA index where it
 * differs), one rounding of GiB and percent, one vocabulary (attach / detach /
 * force-detach / waiting). Pure functions of the model's state, so the status
 * bar, toolbar, panel and notifications agree and are tested without a DOM.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { IKernelGpus, isUnreachable } from './gpuModel';
import { IAttachedGpu, IGpuMetrics, INodeGpu, ISuspended } from './types';

export const GIB = 1024 ** 3;

/** Memory use (fraction of total) from which views show a warning colour. */
export const MEMORY_WARNING = 0.9;

/** GiB as every view shows them: one decimal below 10, whole numbers above. */
export function gib(bytes: number): string {
  const value = bytes / GIB;
  return value < 10 ? value.toFixed(1) : value.toFixed(0);
}

const BINARY_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/**
 * "3.0 GiB", "5.0 MiB", "512 B": the unit the size reaches, rounded as `gib`
 * (and as `%gpu`'s `render.human_bytes`, so both views say the same size).
 */
export function binaryBytes(bytes: number): string {
  let amount = bytes;
  let at = 0;
  while (amount >= 1024 && at < BINARY_UNITS.length - 1) {
    amount /= 1024;
    at += 1;
  }
  if (at === 0) {
    return `${bytes} B`;
  }
  return `${amount < 10 ? amount.toFixed(1) : amount.toFixed(0)} ${BINARY_UNITS[at]}`;
}

/** Decimal units of a rate, as PCIe and NVLink speeds are quoted. */
const RATE_UNITS = ['B/s', 'kB/s', 'MB/s', 'GB/s', 'TB/s'];

/**
 * The unit a chart of rates up to `max` bytes/s counts in, and its size in
 * bytes/s: the largest unit that `max` reaches (B/s for 0).
 */
export function rateUnit(max: number): { unit: string; size: number } {
  let at = 0;
  while (at < RATE_UNITS.length - 1 && max >= 1000 ** (at + 1)) {
    at += 1;
  }
  return { unit: RATE_UNITS[at], size: 1000 ** at };
}

/** "12.3 GB/s", "640 kB/s": one decimal below 10, as `gib`. */
export function bytesPerSecond(value: number): string {
  const { unit, size } = rateUnit(value);
  const scaled = value / size;
  return `${scaled < 10 && size > 1 ? scaled.toFixed(1) : scaled.toFixed(0)} ${unit}`;
}

/** "77 %". */
export function percent(value: number): string {
  return `${Math.round(value)} %`;
}

/** "GPU 1": the node's index, the number `nvidia-smi` on the host shows. */
export function gpuName(index: number, trans: TranslationBundle): string {
  return trans.__('GPU %1', index);
}

/**
 * The CUDA index a GPU has inside its kernel: the kernel sees only its own
 * GPUs, numbered from 0 in the node's order. `null` when not the kernel's.
 */
export function cudaIndex(
  uuid: string,
  attached: readonly IAttachedGpu[]
): number | null {
  const order = [...attached].sort((a, b) => a.index - b.index);
  const at = order.findIndex(gpu => gpu.uuid === uuid);
  return at < 0 ? null : at;
}

/** "GPU 1", or "GPU 1 (cuda:0 in this notebook)" where the kernel counts differently. */
export function gpuTitle(
  gpu: { uuid: string; index: number },
  attached: readonly IAttachedGpu[],
  trans: TranslationBundle
): string {
  const local = cudaIndex(gpu.uuid, attached);
  return local === null || local === gpu.index
    ? gpuName(gpu.index, trans)
    : trans.__('GPU %1 (cuda:%2 in this notebook)', gpu.index, local);
}

/** "GPU-1a2b3c4d": enough of a UUID to tell GPUs apart; the full one goes in a tooltip. */
export function shortUuid(uuid: string): string {
  const [kind, rest] = [uuid.slice(0, 4), uuid.slice(4)];
  return rest.length > 8 ? `${kind}${rest.slice(0, 8)}` : uuid;
}

/** A notebook's file name without its folders ("team/run.ipynb" → "run.ipynb"). */
export function notebookName(path: string): string {
  return path.split('/').pop() || path;
}

/** "1:05 left", "45 s left", "ending" for a deadline in epoch seconds. */
export function countdown(
  deadline: number,
  nowMs: number,
  trans: TranslationBundle
): string {
  const left = Math.max(0, Math.round(deadline - nowMs / 1000));
  if (left === 0) {
    return trans.__('ending');
  }
  if (left < 60) {
    return trans.__('%1 s left', left);
  }
  const seconds = String(left % 60).padStart(2, '0');
  return trans.__('%1:%2 left', Math.floor(left / 60), seconds);
}

/** Memory in use as a fraction (0–1) of the GPU's, or `null` when not known. */
export function memoryFraction(metrics: IGpuMetrics | null | undefined) {
  const used = metrics?.memory_used ?? null;
  const total = metrics?.memory_total ?? null;
  return used === null || !total ? null : used / total;
}

/** Whether any GPU of the kernel is near its memory limit. */
export function memoryNearLimit(state: IKernelGpus | null): boolean {
  return (state?.reply?.attached ?? []).some(
    gpu => (memoryFraction(gpu.metrics) ?? 0) >= MEMORY_WARNING
  );
}

/** The queue place of the kernel's waiting attach: "queued #1", or `null`. */
export function queuedLabel(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string | null {
  const operation = state?.operation;
  if (operation?.kind !== 'attach' || !operation.waiting) {
    // A wait this page did not start (%gpu attach --wait, the command line)
    // is in the server's queue all the same.
    const queued = (state?.reply?.queue ?? []).find(
      entry => entry.kernel_id === state?.kernelId
    );
    if (queued === undefined || operation?.kind === 'detach') {
      return null;
    }
    return queued.position === null
      ? trans.__('waiting')
      : trans.__('queued #%1', queued.position);
  }
  return operation.position === undefined
    ? trans.__('waiting')
    : trans.__('queued #%1', operation.position);
}

/**
 * The status bar's one line: "2 GPUs · 77 % · 69/160 GiB" (mean utilisation,
 * summed memory), idle "0 attached · 2 free", or what is going on.
 */
export function statusSummary(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  if (state === null) {
    return '';
  }
  const queued = queuedLabel(state, trans);
  if (queued !== null) {
    return trans.__('GPU: %1', queued);
  }
  if (state.operation?.kind === 'attach') {
    return trans.__('GPU: attaching…');
  }
  if (state.operation?.kind === 'detach') {
    return trans.__('GPU: detaching…');
  }
  if (isUnreachable(state)) {
    return trans.__('GPU: disconnected');
  }
  const reply = state.reply;
  if (reply === null) {
    return '';
  }
  const attached = reply.attached;
  const kept = keptState(state);
  if (kept !== null) {
    return kept.state === 'suspending'
      ? trans.__('GPU: suspending…')
      : trans.__('GPU: suspended · %1 free', reply.free);
  }
  if (attached.length === 0) {
    return trans.__('0 attached · %1 free', reply.free);
  }
  const parts = [trans._n('%1 GPU', '%1 GPUs', attached.length)];
  const utilizations = attached
    .map(gpu => gpu.metrics?.utilization_gpu ?? null)
    .filter((value): value is number => value !== null);
  if (utilizations.length > 0) {
    const mean =
      utilizations.reduce((sum, value) => sum + value, 0) / utilizations.length;
    parts.push(percent(mean));
  }
  const used = attached.map(gpu => gpu.metrics?.memory_used ?? null);
  const total = attached.map(gpu => gpu.metrics?.memory_total ?? null);
  if (!used.includes(null) && !total.includes(null)) {
    const sum = (values: (number | null)[]) =>
      values.reduce<number>((a, b) => a + (b ?? 0), 0);
    parts.push(`${gib(sum(used))}/${gib(sum(total))} GiB`);
  }
  return parts.join(' · ');
}

/**
 * What a screen reader is told: the state in words, without the numbers that
 * move every second, so a live region built on it speaks only when something
 * meaningful changes (attached, released, waiting, disconnected, memory full).
 */
export function announcement(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  if (state === null || (state.reply === null && !isUnreachable(state))) {
    return '';
  }
  const queued = queuedLabel(state, trans);
  if (queued !== null) {
    return trans.__('GPU: %1', queued);
  }
  if (state.operation !== null) {
    return '';
  }
  if (isUnreachable(state)) {
    return trans.__('GPU service disconnected');
  }
  const attached = state.reply?.attached ?? [];
  const kept = keptState(state);
  if (kept !== null) {
    return kept.state === 'suspending'
      ? trans.__('Suspending the kernel into host memory')
      : trans.__(
          'No GPU attached, the kernel suspended in host memory, %1 free',
          state.reply?.free ?? 0
        );
  }
  const base =
    attached.length === 0
      ? trans.__('No GPU attached, %1 free', state.reply?.free ?? 0)
      : trans._n('%1 GPU attached', '%1 GPUs attached', attached.length);
  return memoryNearLimit(state)
    ? `${base}. ${trans.__('GPU memory almost full')}`
    : base;
}

/** How a node GPU's row is marked: the kernel's own, free, or taken. */
export function rowState(gpu: INodeGpu): 'mine' | INodeGpu['state'] {
  return gpu.mine ? 'mine' : gpu.state;
}

const SIMULATED_SUFFIX = ' (simulated)';

/** A GPU's model name without the "(simulated)" suffix: views say it once, as a badge. */
export function modelName(name: string): string {
  return name.endsWith(SIMULATED_SUFFIX)
    ? name.slice(0, -SIMULATED_SUFFIX.length)
    : name;
}

/**
 * A kernel's kept CUDA state in a few words, as `%gpu status` says it
 * (`render.suspended_state`): "suspended (state kept, 3.0 GiB in host
 * memory)"; the size only where the driver says it.
 */
export function suspendedState(
  suspended: ISuspended,
  trans: TranslationBundle
): string {
  if (suspended.state === 'suspending') {
    return trans.__(
      'suspending (its CUDA state is being moved to host memory)'
    );
  }
  return suspended.host_memory === null
    ? trans.__('suspended (state kept in host memory)')
    : trans.__(
        'suspended (state kept, %1 in host memory)',
        binaryBytes(suspended.host_memory)
      );
}

/**
 * The sentence the toolbar's tooltip and the panel give a suspended kernel, as
 * `render.suspended_line` does in the notebook: its state and what resumes it.
 */
export function suspendedLine(
  suspended: ISuspended,
  trans: TranslationBundle
): string {
  const count = suspended.uuids.length;
  return trans._n(
    "This notebook's kernel is %2; attaching resumes it on %1 free %3 GPU (the same one when free).",
    "This notebook's kernel is %2; attaching resumes it on %1 free %3 GPUs (the same ones when free).",
    count,
    suspendedState(suspended, trans),
    modelName(suspended.model)
  );
}

/**
 * The kernel's CUDA state the agent keeps while the kernel has no GPU (a
 * release with keep); `null` otherwise, and from a server that does not say.
 * One rule for every view: with a GPU attached again the kernel has resumed.
 */
export function keptState(state: IKernelGpus | null): ISuspended | null {
  const reply = state?.reply ?? null;
  return reply !== null && reply.attached.length === 0
    ? (reply.suspended ?? null)
    : null;
}
