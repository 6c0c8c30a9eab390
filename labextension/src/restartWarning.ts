/**
 * JupyterLab's own "Restart Kernel?" dialog, told about the GPUs: a restart
 * starts the kernel in a new sandbox, and the agent releases the old one's
 * GPUs, so a user who restarts to "clear variables" loses the GPU too.
 *
 * Why by watching the page: the dialog belongs to JupyterLab's session
 * dialogs, a service one plugin provides; replacing it would take every
 * other restart behaviour with it. The dialog is recognised by its title in
 * JupyterLab's own translation, and one paragraph is added to its body.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { IDisposable } from '@lumino/disposable';

import { gpuName } from './format';
import { GpuModel } from './gpuModel';

/** The class of the added paragraph (tests and styles find it by it). */
export const RESTART_WARNING_CLASS = 'jp-GpuHotplug-restartWarning';

export class RestartWarning implements IDisposable {
  /**
   * `trans`: this extension's bundle; `labTrans`: JupyterLab's own (the
   * dialog's title is in its words).
   */
  constructor(
    private readonly _model: GpuModel,
    private readonly _trans: TranslationBundle,
    labTrans: TranslationBundle,
    root: HTMLElement = document.body
  ) {
    this._title = labTrans.__('Restart Kernel?');
    this._observer = new MutationObserver(records => {
      for (const record of records) {
        record.addedNodes.forEach(node => this._check(node));
      }
    });
    this._observer.observe(root, { childList: true });
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    this._disposed = true;
    this._observer.disconnect();
  }

  private _check(node: Node): void {
    if (
      !(node instanceof HTMLElement) ||
      !node.classList.contains('jp-Dialog')
    ) {
      return;
    }
    // The title and body are rendered after the dialog is attached (React):
    // look once they are there, then stop looking.
    if (!this._warn(node)) {
      const watch = new MutationObserver(() => {
        if (this._warn(node) || !node.isConnected) {
          watch.disconnect();
        }
      });
      watch.observe(node, {
        childList: true,
        subtree: true,
        characterData: true
      });
    }
  }

  /** Whether `dialog` could be judged (and warned, if it is the restart). */
  private _warn(dialog: HTMLElement): boolean {
    const header = dialog.querySelector('.jp-Dialog-header');
    const body = dialog.querySelector('.jp-Dialog-body');
    const title = header?.textContent?.trim() ?? '';
    if (title === '' || body === null || body.textContent === '') {
      return false;
    }
    if (
      title !== this._title ||
      body.querySelector(`.${RESTART_WARNING_CLASS}`) !== null
    ) {
      return true;
    }
    const attached = this._model.state(this._model.current)?.reply?.attached;
    if (attached === undefined || attached.length === 0) {
      return true;
    }
    const names = attached.map(gpu => gpuName(gpu.index, this._trans));
    const warning = document.createElement('p');
    warning.className = RESTART_WARNING_CLASS;
    warning.textContent = this._trans._n(
      'Its GPU (%2) will be released: the restarted kernel starts without a GPU; attach again afterwards.',
      'Its %1 GPUs (%2) will be released: the restarted kernel starts without GPUs; attach again afterwards.',
      names.length,
      names.join(', ')
    );
    body.appendChild(warning);
    return true;
  }

  private readonly _observer: MutationObserver;
  private readonly _title: string;
  private _disposed = false;
}
