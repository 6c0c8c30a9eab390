/**
 * TypeScript mirrors of the JSON bodies the server extension returns. Each
 * interface names its endpoint so that a change on the Python side has one
 * obvious place to be reflected here.
 */

/** `GET <base_url>/gpu-hotplug/api/version` */
export interface IVersionReply {
  /** The installed `jupyter_gpu_hotplug` Python package version, e.g. "0.1.0". */
  version: string;
}
