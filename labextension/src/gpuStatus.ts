/**
 * The status bar item: one compact summary of the current notebook's GPUs
 * ("2 GPUs · 77 % · 69/160 GiB"; idle "0 attached · 2 free"), in a warning
 * colour when a GPU's memory is nearly full; a click opens the GPU panel.
 *
 * The visible text changes with every reading, so it is not a live region:
 * a visually hidden one beside it carries `announcement()`, which changes only
 * when something meaningful does (attached, released, waiting, disconnected),
 * so screen readers are not told the utilisation every second.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { Classes, GPU_STATUS_ITEM_ID } from './constants';
import { announcement, memoryNearLimit, statusSummary } from './format';
import { GpuModel, IKernelGpus, isUnreachable } from './gpuModel';

/**
 * Whether the item has anything to say about `state`: a reading, or that the
 * GPU service is down. A server without the extension (404) hides it.
 */
export function hasStatus(state: IKernelGpus | null): boolean {
  return state !== null && (state.reply !== null || isUnreachable(state));
}

export class GpuStatus extends Widget {
  constructor(
    private readonly _model: GpuModel,
    private readonly _trans: TranslationBundle,
    private readonly _openPanel: () => void
  ) {
    super({ node: document.createElement('button') });
    this.id = GPU_STATUS_ITEM_ID;
    this.addClass(Classes.gpuStatus);
    this._text = document.createElement('span');
    this._text.className = `${Classes.gpuStatus}-text`;
    this._live = document.createElement('span');
    this._live.className = Classes.srOnly;
    this._live.setAttribute('role', 'status');
    this.node.append(this._text, this._live);
    this.node.title = _trans.__(
      "This notebook's GPUs: click to open the GPU panel"
    );
    this.node.addEventListener('click', () => this._openPanel());
    _model.onCurrent(this._render, this);
    this._render();
  }

  private _render(): void {
    const state = this._model.state(this._model.current);
    this._text.textContent = statusSummary(state, this._trans);
    this.toggleClass(Classes.warning, memoryNearLimit(state));
    // Empty while an action runs: the region keeps what it last said.
    const said = announcement(state, this._trans);
    if (said !== '' && said !== this._live.textContent) {
      this._live.textContent = said;
    }
  }

  private readonly _text: HTMLSpanElement;
  private readonly _live: HTMLSpanElement;
}
