/**
 * Every id, class name and URL fragment the frontend shares with CSS, tests and
 * the server, kept in one module so that a rename cannot silently miss a user.
 */

/** The npm package name; JupyterLab keys the extension and its plugins by it. */
export const EXTENSION_NAME = 'jupyter-gpu-hotplug';

/** Plugin ids (`<package>:<plugin>`), as listed in JupyterLab's plugin manager. */
export const PluginIds = {
  /** Owns the settings schema (`schema/plugin.json`): toolbar, commands, panel. */
  gpus: `${EXTENSION_NAME}:plugin`
} as const;

/**
 * The GPU status bar item (this kernel's GPUs at a glance): its registry id is
 * also the DOM id, which browser tests and `style/base.css` select on.
 */
export const GPU_STATUS_ITEM_ID = 'jp-gpu-hotplug-gpus-status';

/** Name of the notebook toolbar item (settings `jupyter.lab.toolbars`). */
export const TOOLBAR_ITEM_NAME = 'gpu-hotplug';

/** The side panel's widget id (restorer, `shell.activateById`, tests). */
export const PANEL_ID = 'jp-gpu-hotplug-panel';

/** The id of the panel opened in the main area (one at a time). */
export const MAIN_PANEL_ID = 'jp-gpu-hotplug-main';

/** CSS classes (see `style/base.css`). */
export const Classes = {
  toolbarButton: 'jp-GpuHotplug-toolbarButton',
  attaching: 'jp-mod-attaching',
  unreachable: 'jp-mod-unreachable',
  active: 'jp-mod-gpus',
  /** The kernel's CUDA state is kept in host memory without GPUs (issue 39). */
  suspended: 'jp-mod-suspended',
  menu: 'jp-GpuHotplug-menu',
  panel: 'jp-GpuHotplug-panel',
  gpuStatus: 'jp-GpuHotplug-gpuStatus',
  chart: 'jp-GpuHotplug-chart',
  dialog: 'jp-GpuHotplug-dialog',
  /** A destructive menu item or button (force-detach). */
  destructive: 'jp-mod-destructive',
  /** Memory near its limit (status bar, panel). */
  warning: 'jp-mod-warning',
  disconnected: 'jp-mod-disconnected',
  /** Visually hidden text that screen readers still read. */
  srOnly: 'jp-GpuHotplug-srOnly'
} as const;

/** Command ids: palette entries, menu items, settable shortcuts. */
export const CommandIds = {
  attach: 'gpu-hotplug:attach',
  detach: 'gpu-hotplug:detach',
  detachAll: 'gpu-hotplug:detach-all',
  forceDetach: 'gpu-hotplug:force-detach',
  releaseKeep: 'gpu-hotplug:release-keep',
  openPanel: 'gpu-hotplug:open-panel',
  openMain: 'gpu-hotplug:open-in-main-area',
  openMenu: 'gpu-hotplug:open-menu',
  cancelWait: 'gpu-hotplug:cancel-wait'
} as const;

/** Where the server extension mounts its REST API, relative to the server's base URL. */
export const API_NAMESPACE = 'gpu-hotplug/api';

/** REST endpoints below `API_NAMESPACE`. */
export const Endpoints = {
  gpus: 'gpus',
  history: 'history',
  attach: 'attach',
  detach: 'detach',
  cancel: 'cancel',
  stream: 'stream'
} as const;

/** The translation domain of every user-visible string. */
export const TRANSLATION_DOMAIN = 'jupyter_gpu_hotplug';
