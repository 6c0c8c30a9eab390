/**
 * The one model of "which GPUs does this kernel have, and what are they
 * doing", shared by the notebook toolbar item, the GPU panel and the status
 * bar: views render it, none of them polls or streams on its own.
 *
 * It keeps a state per *watched* kernel (each open notebook's toolbar watches
 * its own kernel; the panel and the status bar watch the current one), fed by
 * one live stream per kernel (`GpuStream`; the server feeds all of them from a
 * single poll of the agent) or, with the stream turned off in the settings, by
 * a `GET gpus` when watching starts and after every action. Attach and detach
 * go through it too, so every view sees an action start and end.
 */
import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { Endpoints } from './constants';
import { apiUrl, describeError, requestAPI } from './handler';
import { newRequestId } from './requestId';
import { IGpuSettings, MAX_CHART_MINUTES } from './settings';
import { GpuStream, IStreamHandlers } from './stream';
import {
  IAttachReply,
  IAttachedGpu,
  IErrorBody,
  IGpusReply,
  IGpuMetrics,
  IHistoryReply,
  IProgress,
  INodeGpu,
  ReleaseReason
} from './types';

/** One reading of a GPU for its charts; `null`: not offered. */
export interface ISample {
  /** Milliseconds since the epoch. */
  time: number;
  /** Percent of time a kernel ran. */
  utilization: number | null;
  /** Percent of time memory was read or written. */
  memoryActivity: number | null;
  /** Bytes. */
  memoryUsed: number | null;
  /** Bytes. */
  memoryTotal: number | null;
  /** Bytes/s over PCIe, sent and received. */
  pcieTx: number | null;
  pcieRx: number | null;
  /** Bytes/s over all NVLinks; `null` on a GPU without NVLink. */
  nvlinkTx: number | null;
  nvlinkRx: number | null;
}

/**
 * Why an attach ended without GPUs because the user asked it to stop waiting
 * (`cancel`): not an error to show as one.
 */
export class AttachCancelled extends Error {
  constructor(readonly requestId: string) {
    super('stopped waiting for a free GPU');
  }
}

/** An action of the user in flight. */
export interface IOperation {
  kind: 'attach' | 'detach';
  count: number;
  /** The attach waits for a GPU to become free. */
  waiting: boolean;
  requestId?: string;
  /** Its place in the agent's queue while it waits (local mode), when known. */
  position?: number;
  /** How many requests wait on the node. */
  of?: number;
}

/** How the kernel's live updates arrive now. */
export type Connection =
  'connecting' | 'open' | 'reconnecting' | 'off' | 'paused';

/** Everything the views know about one kernel's GPUs. */
export interface IKernelGpus {
  readonly kernelId: string;
  /** The latest reading; `null` until the first one. */
  readonly reply: IGpusReply | null;
  /** Why the latest reading failed (cleared by the next good one). */
  readonly error: IErrorBody | null;
  readonly operation: IOperation | null;
  readonly connection: Connection;
  /** Chart samples by GPU uuid, for every GPU of the node (the last minutes). */
  readonly history: ReadonlyMap<string, readonly ISample[]>;
}

/** The GPUs of the reading's kernel. */
export function attachedCount(state: IKernelGpus | null): number {
  return state?.reply?.attached.length ?? 0;
}

/** Whether the GPU service cannot be reached (the agent, or the server itself). */
export function isUnreachable(state: IKernelGpus | null): boolean {
  if (state === null) {
    return false;
  }
  if (state.connection === 'reconnecting') {
    return true;
  }
  const status = state.error?.status;
  return (
    state.error?.error === 'network_error' ||
    (status !== undefined && status >= 502 && status <= 504)
  );
}

/** The node's GPUs (older servers: none listed). */
export function nodeGpus(state: IKernelGpus | null): readonly INodeGpu[] {
  return state?.reply?.node ?? [];
}

/** Opens a stream for a kernel (tests replace it). */
export type StreamOpener = (
  kernelId: string,
  handlers: IStreamHandlers
) => IDisposable;

export interface IGpuModelOptions {
  /** The user's settings (see `settings.ts`); replaced when they change. */
  settings: IGpuSettings;
  request?: typeof requestAPI;
  openStream?: StreamOpener;
  now?: () => number;
  /** A new request id (tests pass their own). */
  newRequestId?: () => string;
  /** Load the server's history when a kernel is first watched (default true). */
  history?: boolean;
}

/** GPUs a kernel lost without a detach of this page: the agent's idle policy, a restart. */
export interface IReleased {
  kernelId: string;
  gpus: readonly IAttachedGpu[];
  /** Why, by UUID, as the server saw it (none from older servers). */
  reasons: ReadonlyMap<string, ReleaseReason>;
}

class Watched {
  constructor(kernelId: string) {
    this.state = {
      kernelId,
      reply: null,
      error: null,
      operation: null,
      connection: 'connecting',
      history: new Map()
    };
  }
  state: IKernelGpus;
  watchers = 0;
  stream: IDisposable | null = null;
}

export class GpuModel implements IDisposable {
  constructor(options: IGpuModelOptions) {
    this._request = options.request ?? requestAPI;
    this._history = options.history ?? true;
    this._openStream = options.openStream ?? openStream;
    this._settings = options.settings;
    this._now = options.now ?? Date.now;
    this._newRequestId = options.newRequestId ?? newRequestId;
  }

  get settings(): IGpuSettings {
    return this._settings;
  }

  /** New settings; streams open or close at once when `stream` changes. */
  set settings(settings: IGpuSettings) {
    const streamChanged = settings.stream !== this._settings.stream;
    this._settings = settings;
    if (streamChanged) {
      for (const watched of this._watched.values()) {
        this._connect(watched);
      }
    }
  }

  /**
   * Standby: while the page is hidden the streams are closed (the server then
   * reads nothing for this page); they reopen when it shows again.
   */
  get paused(): boolean {
    return this._paused;
  }

  set paused(paused: boolean) {
    if (paused === this._paused) {
      return;
    }
    this._paused = paused;
    for (const watched of this._watched.values()) {
      this._connect(watched);
    }
  }

  /** The kernel of the notebook in focus (panel, status bar), or `null`. */
  get current(): string | null {
    return this._current;
  }

  set current(kernelId: string | null) {
    if (kernelId === this._current) {
      return;
    }
    this._current = kernelId;
    this._currentChanged.emit(kernelId);
    this._anyChanged.emit();
  }

  /** Emitted with the kernel id whose state changed. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  /** Emitted when anything the views show may have changed (status bar `isActive`). */
  get anyChanged(): ISignal<this, void> {
    return this._anyChanged;
  }

  /** Emitted when `current` changes. */
  get currentChanged(): ISignal<this, string | null> {
    return this._currentChanged;
  }

  /** Call `slot` whenever what the current kernel's views show may change. */
  onCurrent(slot: () => void, owner: object): void {
    this._changed.connect((_, kernelId) => {
      if (kernelId === this._current) {
        slot.call(owner);
      }
    }, owner);
    this._currentChanged.connect(() => slot.call(owner), owner);
  }

  /** Every `progress` event of the watched kernels' streams. */
  get progress(): ISignal<this, IProgress> {
    return this._progress;
  }

  /**
   * GPUs a watched kernel lost that no detach of this page took away (the
   * agent's idle release, a kernel restart, another page's detach).
   */
  get released(): ISignal<this, IReleased> {
    return this._released;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** The state of a watched kernel; `null` if nobody watches it. */
  state(kernelId: string | null): IKernelGpus | null {
    return kernelId === null
      ? null
      : (this._watched.get(kernelId)?.state ?? null);
  }

  /** Start following a kernel; the returned disposable stops (reference counted). */
  watch(kernelId: string): IDisposable {
    let watched = this._watched.get(kernelId);
    if (watched === undefined) {
      watched = new Watched(kernelId);
      this._watched.set(kernelId, watched);
      this._connect(watched);
      if (this._history) {
        void this._loadHistory(kernelId);
      }
    }
    watched.watchers += 1;
    const entry = watched;
    let done = false;
    return {
      get isDisposed() {
        return done;
      },
      dispose: () => {
        if (done) {
          return;
        }
        done = true;
        entry.watchers -= 1;
        if (entry.watchers === 0 && this._watched.get(kernelId) === entry) {
          entry.stream?.dispose();
          this._watched.delete(kernelId);
        }
      }
    };
  }

  /**
   * The server's history of the node's GPUs (the last hour, the same for
   * every page) before this page's own readings; never rejects (an older
   * server has none: the charts then start empty, as before).
   */
  private async _loadHistory(kernelId: string): Promise<void> {
    let reply: IHistoryReply;
    try {
      reply = await this._request<IHistoryReply>(Endpoints.history, {
        method: 'GET'
      });
    } catch {
      return;
    }
    const state = this.state(kernelId);
    if (state === null || reply === null || typeof reply.gpus !== 'object') {
      return;
    }
    const history = new Map(state.history);
    for (const [uuid, readings] of Object.entries(reply.gpus)) {
      const own = history.get(uuid) ?? [];
      const first = own.length > 0 ? own[0].time : Infinity;
      const older: ISample[] = readings
        .map(
          ([at, utilization, activity, used, total, ...traffic]): ISample => ({
            time: at * 1000,
            utilization,
            memoryActivity: activity,
            memoryUsed: used,
            memoryTotal: total,
            pcieTx: traffic[0] ?? null,
            pcieRx: traffic[1] ?? null,
            nvlinkTx: traffic[2] ?? null,
            nvlinkRx: traffic[3] ?? null
          })
        )
        .filter(sample => sample.time < first);
      history.set(uuid, [...older, ...own]);
    }
    this._update(kernelId, { history });
  }

  /** Read the kernel's GPUs now (`GET gpus`); never rejects. */
  async refresh(kernelId: string): Promise<void> {
    try {
      const reply = await this._request<IGpusReply>(
        `${Endpoints.gpus}?kernel_id=${encodeURIComponent(kernelId)}`
      );
      this._onMetrics(kernelId, reply);
    } catch (error) {
      this._update(kernelId, { error: describeError(error) });
    }
  }

  /**
   * Attach `count` GPUs to the kernel: those of `gpus` (UUIDs, `count` of
   * them) when given, else any free ones. With `waitSeconds`, the server waits
   * that long for them to become free. Rejects with the request's error.
   */
  async attach(
    kernelId: string,
    count: number,
    waitSeconds?: number,
    gpus: readonly string[] = []
  ): Promise<IAttachReply> {
    const requestId = this._newRequestId();
    const body: Record<string, unknown> = {
      count,
      kernel_id: kernelId,
      request_id: requestId
    };
    if (waitSeconds !== undefined) {
      body.wait_seconds = waitSeconds;
    }
    if (gpus.length > 0) {
      body.gpus = gpus;
    }
    try {
      return await this._act(
        kernelId,
        { kind: 'attach', count, waiting: false, requestId },
        () =>
          this._request<IAttachReply>(Endpoints.attach, {
            method: 'POST',
            body: JSON.stringify(body)
          })
      );
    } catch (error) {
      if (
        this._cancelled.has(requestId) &&
        describeError(error).error === 'insufficient_gpus'
      ) {
        throw new AttachCancelled(requestId);
      }
      throw error;
    } finally {
      this._cancelled.delete(requestId);
    }
  }

  /**
   * Stop waiting: the kernel's attach in flight leaves the agent's queue (its
   * `attach()` then rejects with `AttachCancelled`). Rejects with the server's
   * error, e.g. when the attach was served meanwhile; does nothing when no
   * attach is in flight.
   */
  async cancel(kernelId: string, which?: string): Promise<void> {
    // `which`: a wait of the queue that this page did not start (the magic's).
    const own = this.state(kernelId)?.operation?.requestId;
    const requestId = which ?? own;
    if (requestId === undefined) {
      return;
    }
    if (requestId === own) {
      this._cancelled.add(requestId);
    }
    try {
      await this._request<null>(Endpoints.cancel, {
        method: 'POST',
        body: JSON.stringify({ request_id: requestId, kernel_id: kernelId })
      });
    } catch (error) {
      this._cancelled.delete(requestId);
      throw error;
    }
  }

  /**
   * Detach one GPU (`uuid`) or all (`null`) of the kernel; with `keep` (all
   * only), the agent first suspends the kernel's CUDA state into host memory
   * (issue 39). Rejects with the error.
   */
  async detach(
    kernelId: string,
    uuid: string | null,
    force = false,
    keep = false
  ): Promise<void> {
    const attached = this.state(kernelId)?.reply?.attached ?? [];
    const count = uuid === null ? attached.length : 1;
    const taking = attached
      .map(gpu => gpu.uuid)
      .filter(candidate => uuid === null || candidate === uuid);
    for (const gpu of taking) {
      this._detaching.add(gpu);
    }
    try {
      await this._act(kernelId, { kind: 'detach', count, waiting: false }, () =>
        this._request<null>(Endpoints.detach, {
          method: 'POST',
          body: JSON.stringify({
            uuid: uuid ?? 'all',
            force,
            kernel_id: kernelId,
            // Only when asked: a server before issue 39 refuses the member.
            ...(keep ? { keep: true } : {})
          })
        })
      );
    } catch (error) {
      // Refused (busy...): the GPUs stay, and a later loss is not this page's doing.
      for (const gpu of taking) {
        this._detaching.delete(gpu);
      }
      throw error;
    }
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    for (const watched of this._watched.values()) {
      watched.stream?.dispose();
    }
    this._watched.clear();
    Signal.clearData(this);
  }

  private async _act<T>(
    kernelId: string,
    operation: IOperation,
    call: () => Promise<T>
  ): Promise<T> {
    this._update(kernelId, { operation });
    try {
      return await call();
    } finally {
      this._update(kernelId, { operation: null });
      // An open stream brings the next reading anyway; without one, ask.
      if (this.state(kernelId)?.connection !== 'open') {
        void this.refresh(kernelId);
      }
    }
  }

  private _connect(watched: Watched): void {
    watched.stream?.dispose();
    watched.stream = null;
    const kernelId = watched.state.kernelId;
    if (this._paused) {
      this._update(kernelId, { connection: 'paused' });
      return;
    }
    if (!this._settings.stream) {
      this._update(kernelId, { connection: 'off' });
      void this.refresh(kernelId);
      return;
    }
    this._update(kernelId, { connection: 'connecting' });
    watched.stream = this._openStream(kernelId, {
      metrics: reply => this._onMetrics(kernelId, reply),
      progress: progress => this._onProgress(kernelId, progress),
      error: body => this._update(kernelId, { error: body }),
      connection: state => this._update(kernelId, { connection: state })
    });
  }

  private _onMetrics(kernelId: string, reply: IGpusReply): void {
    const watched = this._watched.get(kernelId);
    if (watched === undefined) {
      return;
    }
    const now = this._now();
    const since = now - MAX_CHART_MINUTES * 60_000;
    const history = new Map<string, readonly ISample[]>();
    const charted: { uuid: string; metrics?: IGpuMetrics | null }[] =
      reply.node ?? reply.attached;
    for (const gpu of charted) {
      const sample = toSample(now, gpu.metrics ?? null);
      // A GPU gone from the node loses its history; a new one starts its own.
      const before = watched.state.history.get(gpu.uuid) ?? [];
      history.set(gpu.uuid, [
        ...before.filter(old => old.time >= since),
        sample
      ]);
    }
    const lost = (watched.state.reply?.attached ?? []).filter(
      gpu => !reply.attached.some(kept => kept.uuid === gpu.uuid)
    );
    this._update(kernelId, { reply, error: null, history });
    const unexpected = lost.filter(gpu => !this._detaching.has(gpu.uuid));
    for (const gpu of lost) {
      this._detaching.delete(gpu.uuid);
    }
    if (unexpected.length > 0 && watched.state.operation === null) {
      const reasons = new Map<string, ReleaseReason>(
        (reply.released ?? []).map(r => [r.uuid, r.reason])
      );
      this._released.emit({ kernelId, gpus: unexpected, reasons });
    }
  }

  private _onProgress(kernelId: string, progress: IProgress): void {
    const operation = this.state(kernelId)?.operation;
    if (
      operation?.requestId === progress.request_id &&
      progress.state === 'waiting' &&
      (!operation.waiting ||
        operation.position !== progress.position ||
        operation.of !== progress.of)
    ) {
      this._update(kernelId, {
        operation: {
          ...operation,
          waiting: true,
          position: progress.position,
          of: progress.of
        }
      });
    }
    this._progress.emit(progress);
  }

  private _update(kernelId: string, change: Partial<IKernelGpus>): void {
    const watched = this._watched.get(kernelId);
    if (watched === undefined || this._disposed) {
      return;
    }
    watched.state = { ...watched.state, ...change };
    this._changed.emit(kernelId);
    this._anyChanged.emit();
  }

  private readonly _request: typeof requestAPI;
  private readonly _history: boolean;
  private readonly _openStream: StreamOpener;
  private readonly _now: () => number;
  private readonly _newRequestId: () => string;
  /** Request ids of attaches the user asked to stop waiting. */
  private readonly _cancelled = new Set<string>();
  /** GPUs a detach of this page is taking away (not announced as released). */
  private readonly _detaching = new Set<string>();
  private _settings: IGpuSettings;
  private _current: string | null = null;
  private _paused = false;
  private _disposed = false;
  private readonly _watched = new Map<string, Watched>();
  private readonly _changed = new Signal<this, string>(this);
  private readonly _currentChanged = new Signal<this, string | null>(this);
  private readonly _anyChanged = new Signal<this, void>(this);
  private readonly _progress = new Signal<this, IProgress>(this);
  private readonly _released = new Signal<this, IReleased>(this);
}

/** A chart sample from a reading (`null` metrics: nothing known at that time). */
function toSample(time: number, metrics: IGpuMetrics | null): ISample {
  return {
    time,
    utilization: metrics?.utilization_gpu ?? null,
    memoryActivity: metrics?.utilization_memory ?? null,
    memoryUsed: metrics?.memory_used ?? null,
    memoryTotal: metrics?.memory_total ?? null,
    pcieTx: metrics?.pcie_tx ?? null,
    pcieRx: metrics?.pcie_rx ?? null,
    nvlinkTx: metrics?.nvlink_tx ?? null,
    nvlinkRx: metrics?.nvlink_rx ?? null
  };
}

/** The real stream of a kernel. */
function openStream(kernelId: string, handlers: IStreamHandlers): IDisposable {
  const url = `${apiUrl(Endpoints.stream)}?kernel_id=${encodeURIComponent(kernelId)}`;
  return new GpuStream({ url, handlers });
}
