/**
 * The notebook toolbar item: a button that shows the notebook kernel's GPUs
 * ("GPU · 2 free", "GPU ×2", "queued #1", "GPU · suspended", a distinct look
 * while attaching, while the kernel is suspended, or when the GPU service is
 * unreachable) and opens a menu of `menuEntries`. It
 * sits before the toolbar's spacer (rank 50 in `schema/plugin.json`), so a
 * narrow notebook moves the kernel name into the "⋯" overflow before it. It renders the shared
 * `GpuModel` for its notebook's kernel and follows kernel changes; it never
 * asks the server itself.
 *
 * Keyboard: the button is a real `<button>` (Tab, Enter, Space); the menu is a
 * Lumino `Menu` (arrow keys, Enter, Escape), which gets focus when opened.
 */
import { NotebookPanel } from '@jupyterlab/notebook';
import { TranslationBundle } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';
import { IDisposable } from '@lumino/disposable';
import { Menu, Widget } from '@lumino/widgets';

import { Classes } from './constants';
import { GpuModel, isUnreachable } from './gpuModel';
import { buttonDescription, buttonLabel, menuEntries } from './menu';

export class GpuToolbarButton extends Widget {
  constructor(
    private readonly _panel: NotebookPanel,
    private readonly _model: GpuModel,
    private readonly _commands: CommandRegistry,
    private readonly _trans: TranslationBundle
  ) {
    super({ node: document.createElement('div') });
    this.addClass(Classes.toolbarButton);
    this.addClass('jp-ToolbarButton');
    this._button = document.createElement('button');
    this._button.className = 'jp-ToolbarButtonComponent jp-Button';
    this._button.setAttribute('aria-haspopup', 'menu');
    this._button.setAttribute('aria-expanded', 'false');
    this._label = document.createElement('span');
    this._label.className = 'jp-ToolbarButtonComponent-label';
    this._button.appendChild(this._label);
    this.node.appendChild(this._button);
    this._button.addEventListener('click', () => this.openMenu());

    _model.changed.connect(this._onChanged, this);
    _panel.sessionContext.kernelChanged.connect(this._follow, this);
    this._follow();
  }

  /** The kernel this item shows (`null`: none yet). */
  get kernelId(): string | null {
    return this._panel.sessionContext.session?.kernel?.id ?? null;
  }

  /** Open the menu under the button, focused for the keyboard. */
  openMenu(): void {
    const menu = new Menu({ commands: this._commands });
    menu.addClass(Classes.menu);
    menu.title.label = this._trans.__('GPUs');
    for (const entry of menuEntries(
      this._model.state(this.kernelId),
      this._trans
    )) {
      menu.addItem(
        entry.type === 'separator'
          ? { type: 'separator' }
          : {
              command: entry.command,
              args: {
                ...entry.args,
                label: entry.label,
                enabled: entry.enabled
              }
            }
      );
    }
    this._button.setAttribute('aria-expanded', 'true');
    menu.aboutToClose.connect(() => {
      this._button.setAttribute('aria-expanded', 'false');
      // Back to the button, so keyboard users keep their place.
      requestAnimationFrame(() => this._button.focus());
    });
    menu.disposed.connect(() =>
      this._button.setAttribute('aria-expanded', 'false')
    );
    const box = this._button.getBoundingClientRect();
    menu.open(box.left, box.bottom);
    // The first item that can run (a disabled note such as "every GPU is
    // here" is skipped).
    menu.activeIndex = -1;
    menu.activateNextItem();
    menu.node.focus();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._watch?.dispose();
    super.dispose();
  }

  private _follow(): void {
    const kernelId = this.kernelId;
    if (kernelId === this._watchedId) {
      return;
    }
    this._watch?.dispose();
    this._watch = kernelId === null ? null : this._model.watch(kernelId);
    this._watchedId = kernelId;
    this._render();
  }

  private _onChanged(_: GpuModel, kernelId: string): void {
    if (kernelId === this._watchedId) {
      this._render();
    }
  }

  private _render(): void {
    const state = this._model.state(this.kernelId);
    const description = buttonDescription(state, this._trans);
    this._label.textContent = buttonLabel(state, this._trans);
    this._button.title = description;
    this._button.setAttribute('aria-label', description);
    this.toggleClass(Classes.attaching, state?.operation != null);
    this.toggleClass(Classes.unreachable, isUnreachable(state));
    this.toggleClass(Classes.active, (state?.reply?.attached.length ?? 0) > 0);
    this.toggleClass(
      Classes.suspended,
      (state?.reply?.suspended ?? null) !== null
    );
  }

  private readonly _button: HTMLButtonElement;
  private readonly _label: HTMLSpanElement;
  private _watch: IDisposable | null = null;
  private _watchedId: string | null | undefined = undefined;
}
