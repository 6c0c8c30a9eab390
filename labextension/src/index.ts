/**
 * Plugin wiring only: each plugin connects a model to its views and to
 * JupyterLab services. Behaviour lives in the modules imported here.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  IToolbarWidgetRegistry,
  Notification
} from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { IDisposable } from '@lumino/disposable';

import { addCommands } from './commands';
import {
  CommandIds,
  GPU_STATUS_ITEM_ID,
  PANEL_ID,
  PluginIds,
  STATUS_ITEM_ID,
  TOOLBAR_ITEM_NAME,
  TRANSLATION_DOMAIN
} from './constants';
import { DEFAULT_SETTINGS, GpuModel, IGpuSettings } from './gpuModel';
import { GpuStatus, hasStatus } from './gpuStatus';
import { gpuIcon } from './icons';
import { LostHolderWarnings } from './lostHolders';
import { ServerVersionModel } from './model';
import { GpuPanel } from './panel';
import { ServerVersionStatus } from './statusItem';
import { GpuToolbarButton } from './toolbar';

/** Shows the server extension's version in the status bar while it is reachable. */
const statusItemPlugin: JupyterFrontEndPlugin<void> = {
  id: PluginIds.statusItem,
  description:
    'Shows the jupyter-gpu-hotplug server extension version in the status bar.',
  autoStart: true,
  optional: [IStatusBar],
  activate: (_app: JupyterFrontEnd, statusBar: IStatusBar | null): void => {
    if (statusBar === null) {
      return;
    }
    const model = new ServerVersionModel();
    statusBar.registerStatusItem(STATUS_ITEM_ID, {
      item: new ServerVersionStatus(model),
      align: 'left',
      rank: 100,
      isActive: () => model.state.kind === 'ready',
      activeStateChanged: model.stateChanged
    });
    void model.refresh();
  }
};

/** `settings` completed with the defaults. */
function readSettings(settings: ISettingRegistry.ISettings): IGpuSettings {
  const get = <K extends keyof IGpuSettings>(key: K): IGpuSettings[K] =>
    (settings.composite[key] as IGpuSettings[K] | undefined) ??
    DEFAULT_SETTINGS[key];
  return {
    defaultCount: get('defaultCount'),
    confirmDetach: get('confirmDetach'),
    stream: get('stream'),
    chartHistory: get('chartHistory'),
    waitSeconds: get('waitSeconds')
  };
}

/** The notebook toolbar item, the GPU panel, the status bar item, the commands. */
const gpuPlugin: JupyterFrontEndPlugin<void> = {
  id: PluginIds.gpus,
  description:
    "Shows and changes the notebook kernel's GPUs: toolbar item, side panel, status bar, commands.",
  autoStart: true,
  requires: [INotebookTracker, IToolbarWidgetRegistry],
  optional: [
    ISettingRegistry,
    ITranslator,
    ICommandPalette,
    ILayoutRestorer,
    IStatusBar
  ],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    toolbarRegistry: IToolbarWidgetRegistry,
    settingRegistry: ISettingRegistry | null,
    translator: ITranslator | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null
  ): void => {
    const trans = (translator ?? nullTranslator).load(TRANSLATION_DOMAIN);
    const model = new GpuModel();
    // Standby while the page is hidden: no stream, no cost on the server.
    document.addEventListener('visibilitychange', () => {
      model.paused = document.visibilityState === 'hidden';
    });

    const buttons = new WeakMap<NotebookPanel, GpuToolbarButton>();
    toolbarRegistry.addFactory<NotebookPanel>(
      'Notebook',
      TOOLBAR_ITEM_NAME,
      panel => {
        const button = new GpuToolbarButton(panel, model, app.commands, trans);
        buttons.set(panel, button);
        return button;
      }
    );

    // The panel and the status bar follow the kernel of the notebook in focus.
    let followed: NotebookPanel | null = null;
    const followCurrent = () => {
      model.current = followed?.sessionContext.session?.kernel?.id ?? null;
    };
    tracker.currentChanged.connect((_, panel) => {
      followed?.sessionContext.kernelChanged.disconnect(followCurrent);
      followed = panel;
      followed?.sessionContext.kernelChanged.connect(followCurrent);
      followCurrent();
    });
    let currentWatch: IDisposable | null = null;
    model.currentChanged.connect((_, kernelId) => {
      currentWatch?.dispose();
      currentWatch = kernelId === null ? null : model.watch(kernelId);
    });

    // A lost holder's warning comes before the agent revokes the GPU.
    new LostHolderWarnings(model, trans, message => {
      Notification.warning(message, { autoClose: false });
    });

    const panel = new GpuPanel(model, trans);
    panel.title.icon = gpuIcon;
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, PANEL_ID);

    statusBar?.registerStatusItem(GPU_STATUS_ITEM_ID, {
      item: new GpuStatus(model, trans),
      align: 'left',
      rank: 50,
      isActive: () => hasStatus(model.state(model.current)),
      activeStateChanged: model.anyChanged
    });

    addCommands({
      commands: app.commands,
      model,
      trans,
      currentKernel: () => model.current,
      kernelConnection: kernelId =>
        tracker.find(
          widget => widget.sessionContext.session?.kernel?.id === kernelId
        )?.sessionContext.session?.kernel ?? null,
      openPanel: () => app.shell.activateById(PANEL_ID),
      openMenu: () => {
        const current = tracker.currentWidget;
        const button = current === null ? undefined : buttons.get(current);
        button?.openMenu();
        return button !== undefined;
      }
    });
    const category = trans.__('GPU');
    for (const command of [
      CommandIds.attach,
      CommandIds.detachAll,
      CommandIds.forceDetach,
      CommandIds.openPanel,
      CommandIds.openMenu
    ]) {
      palette?.addItem({ command, category });
    }

    if (settingRegistry !== null) {
      void settingRegistry.load(PluginIds.gpus).then(settings => {
        model.settings = readSettings(settings);
        settings.changed.connect(() => {
          model.settings = readSettings(settings);
        });
      });
    }
  }
};

export default [statusItemPlugin, gpuPlugin];
