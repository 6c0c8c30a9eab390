/**
 * Warns the user when a GPU of theirs lost what reserved it: its holder pod was preempted,
 * evicted or deleted, and the agent takes the access away at `revoke_at` (after its grace
 * period). The agent's notice reaches the lab on the live stream (`holder_lost` on the
 * attachment); the warning must come before the revoke and stay until dismissed, so work can
 * be saved. One warning per GPU and announcement.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { IDisposable } from '@lumino/disposable';
import { ISignal } from '@lumino/signaling';

import { IKernelGpus } from './gpuModel';
import { IAttachedGpu } from './types';

/** What the warnings read of the model. */
export interface ILostHolderSource {
  readonly changed: ISignal<unknown, string>;
  state(kernelId: string | null): IKernelGpus | null;
}

export type Warn = (message: string) => void;

/** The warning for `gpu`, or `null` when its reservation stands. */
export function lostHolderMessage(
  gpu: IAttachedGpu,
  trans: TranslationBundle
): string | null {
  const notice = gpu.holder_lost;
  if (notice === undefined) {
    return null;
  }
  const when = new Date(notice.revoke_at).toLocaleTimeString();
  return trans.__(
    'GPU %1 (%2) lost its reservation: %3. Access to it ends at %4; save your work.',
    gpu.index,
    gpu.device,
    notice.reason,
    when
  );
}

/** Shows each announced loss once through `warn` (see the module comment). */
export class LostHolderWarnings implements IDisposable {
  constructor(
    private readonly _source: ILostHolderSource,
    private readonly _trans: TranslationBundle,
    private readonly _warn: Warn
  ) {
    this._source.changed.connect(this._onChanged, this);
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    if (!this._disposed) {
      this._disposed = true;
      this._source.changed.disconnect(this._onChanged, this);
    }
  }

  private _onChanged(_: unknown, kernelId: string): void {
    for (const gpu of this._source.state(kernelId)?.reply?.attached ?? []) {
      const message = lostHolderMessage(gpu, this._trans);
      const key = `${gpu.uuid} ${gpu.holder_lost?.revoke_at}`;
      if (message !== null && !this._shown.has(key)) {
        this._shown.add(key);
        this._warn(message);
      }
    }
  }

  private readonly _shown = new Set<string>();
  private _disposed = false;
}
