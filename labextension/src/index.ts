/**
 * Plugin wiring only: each plugin connects a model to its views and to
 * JupyterLab services. Behaviour lives in the modules imported here.
 */
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  IToolbarWidgetRegistry,
  MainAreaWidget,
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
  MAIN_PANEL_ID,
  PANEL_ID,
  PluginIds,
  TOOLBAR_ITEM_NAME,
  TRANSLATION_DOMAIN
} from './constants';
import { notebookName } from './format';
import { GpuModel } from './gpuModel';
import { GpuStatus, hasStatus } from './gpuStatus';
import { gpuIcon } from './icons';
import { LostHolderWarnings } from './lostHolders';
import { GpuPanel } from './panel';
import { RestartWarning } from './restartWarning';
import { readSettings } from './settings';
import { GpuToolbarButton } from './toolbar';

/** The notebook toolbar item, the GPU panel, the status bar item, the commands. */
const gpuPlugin: JupyterFrontEndPlugin<void> = {
  id: PluginIds.gpus,
  description:
    "Shows and changes the notebook kernel's GPUs: toolbar item, side panel, status bar, commands.",
  autoStart: true,
  requires: [INotebookTracker, IToolbarWidgetRegistry, ISettingRegistry],
  optional: [ITranslator, ICommandPalette, ILayoutRestorer, IStatusBar],
  activate: async (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    toolbarRegistry: IToolbarWidgetRegistry,
    settingRegistry: ISettingRegistry,
    translator: ITranslator | null,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null
  ): Promise<void> => {
    const trans = (translator ?? nullTranslator).load(TRANSLATION_DOMAIN);
    // The schema's defaults arrive in `composite`: nothing here repeats them.
    const settings = await settingRegistry.load(PluginIds.gpus);
    const model = new GpuModel({ settings: readSettings(settings.composite) });
    settings.changed.connect(() => {
      model.settings = readSettings(settings.composite);
    });
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

    // Restarting the kernel releases its GPUs: JupyterLab's dialog says so.
    new RestartWarning(
      model,
      trans,
      (translator ?? nullTranslator).load('jupyterlab')
    );

    // A lost holder's warning comes before the agent revokes the GPU.
    new LostHolderWarnings(model, trans, message => {
      Notification.warning(message, { autoClose: false });
    });

    const panel = new GpuPanel({ model, commands: app.commands, trans });
    panel.id = PANEL_ID;
    panel.title.icon = gpuIcon;
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, PANEL_ID);
    const openPanel = () => app.shell.activateById(PANEL_ID);

    let mainArea: MainAreaWidget<GpuPanel> | null = null;
    const openMainArea = () => {
      if (mainArea === null || mainArea.isDisposed) {
        const content = new GpuPanel({
          model,
          commands: app.commands,
          trans,
          inMainArea: true
        });
        mainArea = new MainAreaWidget({ content });
        mainArea.id = MAIN_PANEL_ID;
        mainArea.title.label = trans.__('GPUs');
        mainArea.title.icon = gpuIcon;
        mainArea.title.closable = true;
        app.shell.add(mainArea, 'main', { mode: 'split-right' });
      }
      app.shell.activateById(MAIN_PANEL_ID);
      // The same view twice is noise: the side panel makes room for it.
      if (panel.isVisible && 'collapseRight' in app.shell) {
        (app.shell as unknown as ILabShell).collapseRight();
      }
    };

    statusBar?.registerStatusItem(GPU_STATUS_ITEM_ID, {
      item: new GpuStatus(model, trans, openPanel),
      align: 'left',
      rank: 50,
      isActive: () => hasStatus(model.state(model.current)),
      activeStateChanged: model.anyChanged
    });

    const notebookOf = (kernelId: string) =>
      tracker.find(
        widget => widget.sessionContext.session?.kernel?.id === kernelId
      ) ?? null;
    addCommands({
      commands: app.commands,
      model,
      trans,
      currentKernel: () => model.current,
      kernelConnection: kernelId =>
        notebookOf(kernelId)?.sessionContext.session?.kernel ?? null,
      notebookName: kernelId => {
        const path = notebookOf(kernelId)?.sessionContext.path;
        return path ? notebookName(path) : trans.__('this notebook');
      },
      openPanel,
      openMainArea,
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
      CommandIds.openMain,
      CommandIds.openMenu
    ]) {
      palette?.addItem({ command, category });
    }
  }
};

export default [gpuPlugin];
