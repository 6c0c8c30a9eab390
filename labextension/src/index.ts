/**
 * Plugin wiring only: each plugin connects a model to its views and to
 * JupyterLab services. Behaviour lives in the modules imported here.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { IStatusBar } from '@jupyterlab/statusbar';

import { PluginIds, STATUS_ITEM_ID } from './constants';
import { ServerVersionModel } from './model';
import { ServerVersionStatus } from './statusItem';

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

export default [statusItemPlugin];
