/**
 * The status bar view: renders a `ServerVersionModel` and nothing else. Whether
 * it is shown at all is the status bar's decision, driven by `isActive` (see
 * `index.ts`), so the view never hides or shows itself.
 */
import { Widget } from '@lumino/widgets';

import { STATUS_ITEM_CLASS, STATUS_ITEM_ID } from './constants';
import { ServerVersionModel } from './model';

/** "GPU hot-plug v<version>" in the status bar. */
export class ServerVersionStatus extends Widget {
  constructor(private readonly _model: ServerVersionModel) {
    super();
    this.id = STATUS_ITEM_ID;
    this.addClass(STATUS_ITEM_CLASS);
    this._model.stateChanged.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.stateChanged.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const state = this._model.state;
    switch (state.kind) {
      case 'ready':
        this.node.textContent = `GPU hot-plug v${state.version}`;
        this.node.title = 'jupyter-gpu-hotplug server extension is running';
        break;
      case 'loading':
        this.node.textContent = '';
        this.node.title = '';
        break;
      case 'unavailable':
        this.node.textContent = '';
        this.node.title = state.reason;
        break;
    }
  }
}
