/**
 * Every id, class name and URL fragment the frontend shares with CSS, tests and
 * the server, kept in one module so that a rename cannot silently miss a user.
 */

/** The npm package name; JupyterLab keys the extension and its plugins by it. */
export const EXTENSION_NAME = 'jupyter-gpu-hotplug';

/** Plugin ids (`<package>:<plugin>`), as listed in JupyterLab's plugin manager. */
export const PluginIds = {
  statusItem: `${EXTENSION_NAME}:status-item`
} as const;

/**
 * The status bar item: its registry id is also the DOM id, which browser tests
 * and `style/base.css` select on.
 */
export const STATUS_ITEM_ID = 'jp-gpu-hotplug-status';

/** CSS class on the status bar item (see `style/base.css`). */
export const STATUS_ITEM_CLASS = 'jp-GpuHotplug-status';

/** Where the server extension mounts its REST API, relative to the server's base URL. */
export const API_NAMESPACE = 'gpu-hotplug/api';

/** REST endpoints below `API_NAMESPACE`. */
export const Endpoints = {
  version: 'version'
} as const;
