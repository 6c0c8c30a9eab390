/**
 * The status bar item: the current kernel's GPUs with utilisation and memory
 * at a glance ("GPU 0 37% · 2.1/16 GiB"), from the shared model. Whether it
 * shows at all is the status bar's call through `isActive` (see `index.ts`):
 * nothing attached and nothing going on means nothing to show.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { Classes, GPU_STATUS_ITEM_ID } from './constants';
import {
  GpuModel,
  IKernelGpus,
  attachedCount,
  isUnreachable
} from './gpuModel';

const GIB = 1024 ** 3;

/** Whether the item has anything to say about `state`. */
export function hasStatus(state: IKernelGpus | null): boolean {
  return (
    attachedCount(state) > 0 || state?.operation != null || isUnreachable(state)
  );
}

/** The item's text for `state`. */
export function statusText(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  if (state?.operation?.kind === 'attach') {
    return state.operation.waiting
      ? trans.__('GPU: waiting for a free GPU…')
      : trans.__('GPU: attaching…');
  }
  if (state?.operation?.kind === 'detach') {
    return trans.__('GPU: detaching…');
  }
  if (isUnreachable(state)) {
    return trans.__('GPU: unreachable');
  }
  return (state?.reply?.attached ?? [])
    .map(gpu => {
      const m = gpu.metrics;
      const util = m?.utilization_gpu ?? null;
      const used = m?.memory_used ?? null;
      const total = m?.memory_total ?? null;
      const memory =
        used === null || total === null
          ? ''
          : ` · ${(used / GIB).toFixed(1)}/${(total / GIB).toFixed(0)} GiB`;
      return trans.__(
        'GPU %1 %2%3',
        gpu.index,
        util === null ? '–' : `${util}%`,
        memory
      );
    })
    .join('  ');
}

export class GpuStatus extends Widget {
  constructor(
    private readonly _model: GpuModel,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.id = GPU_STATUS_ITEM_ID;
    this.addClass(Classes.gpuStatus);
    this.node.setAttribute('role', 'status');
    _model.onCurrent(this._render, this);
    this._render();
  }

  private _render(): void {
    const state = this._model.state(this._model.current);
    this.node.textContent = statusText(state, this._trans);
    this.node.title = this._trans.__("This notebook kernel's GPUs");
  }
}
