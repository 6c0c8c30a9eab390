/**
 * TypeScript mirrors of the JSON bodies the server extension returns. Each
 * interface names its endpoint (or stream event) so that a change on the Python
 * side (`jupyter_gpu_hotplug/server/models.py`, `_structs.py`) has one obvious
 * place to be reflected here.
 */

/** `GpuProcessJson` (nvml/state.py): one process using a GPU. */
export interface IGpuProcess {
  pid: number;
  name: string | null;
  used_memory: number | null;
  /** SM utilisation over the last seconds; absent from older servers. */
  sm_util?: number | null;
}

/** `MetricsJson` (server/models.py): what one GPU is doing now; `null`: not offered. */
export interface IGpuMetrics {
  utilization_gpu: number | null;
  utilization_memory: number | null;
  memory_used: number | null;
  memory_total: number | null;
  temperature: number | null;
  power_draw: number | null;
  power_limit: number | null;
  /** Bytes/s over PCIe; absent from older servers. */
  pcie_tx?: number | null;
  pcie_rx?: number | null;
  /** Bytes/s over all NVLinks; `null` on a GPU without NVLink. */
  nvlink_tx?: number | null;
  nvlink_rx?: number | null;
  processes: IGpuProcess[] | null;
  lost: boolean;
}

/** `Attachment` (_structs.py) plus `metrics`: `AttachedGpuJson` (server/models.py). */
export interface IAttachedGpu {
  uuid: string;
  index: number;
  minor: number;
  name: string;
  device: string;
  target:
    { pid: number } | { pod: string; namespace: string; container?: string };
  holder: string | null;
  attached_at: string;
  metrics: IGpuMetrics | null;
  /** Set while the agent announces the revoke of a GPU whose holder pod was lost. */
  holder_lost?: ILostHolder;
}

/** `LostHolderWire` (_structs.py): why, and when the access ends. */
export interface ILostHolder {
  reason: string;
  revoke_at: string;
}

/** Agent GPU states (`GpuState` in _structs.py). */
export type NodeGpuState = 'free' | 'attached' | 'allocated';

/** `HeldByJson` (server/models.py): who holds a GPU, as a user knows it. */
export interface IHeldBy {
  kind: 'notebook' | 'kernel' | 'pod' | 'process';
  /** The notebook's path, "kernel <id>", "namespace/name", "process N". */
  name: string;
  kernel_id: string | null;
}

/** `NodeGpuJson` (server/models.py): one GPU of the node. */
export interface INodeGpu {
  uuid: string;
  index: number;
  minor: number;
  name: string;
  memory_total: number;
  state: NodeGpuState;
  /** Attached to the kernel (or pod) the reading is about. */
  mine: boolean;
  /** Who holds it (`null` when free); absent from older servers. */
  held_by?: IHeldBy | null;
  /** What it is doing (`null`: the server's NVML cannot see it); absent from older servers. */
  metrics?: IGpuMetrics | null;
  /**
   * An attach may name it (`gpus`), so its card's Attach attaches it; false
   * where the cluster picks the device (Kubernetes). Absent from older servers:
   * treat as false.
   */
  selectable?: boolean;
  /**
   * What it is (`GpuKind`, the agent's word): a whole GPU, a GPU in MIG mode
   * (never attached whole, its card offers no Attach) or a MIG slice. Absent
   * from older servers: treat as `gpu` (they listed whole GPUs only).
   */
  kind?: GpuKind;
  /**
   * An attach of a count alone ("Attach N") may get it when free, as the agent
   * says; only such GPUs count in `free` and `total`. Absent from older
   * servers: treat as true (they listed whole GPUs only).
   */
  plain_attach?: boolean;
}

/** `_structs.GpuKind`: what a GPU of the node is. */
export type GpuKind = 'gpu' | 'mig_parent' | 'mig_slice';

/** `QueuedJson` (server/models.py): an attach of this server's kernels waiting for GPUs. */
export interface IQueued {
  request_id: string;
  kernel_id: string | null;
  /** The waiting notebook (`null`: Kubernetes mode, this pod). */
  held_by: IHeldBy | null;
  count: number;
  /** 1 is served next; `null` until the agent has said. */
  position: number | null;
  of: number | null;
  /**
   * Seconds since the epoch when the wait ends; `null` for a wait the server
   * did not start (`%gpu attach --wait`, the command line).
   */
  deadline: number | null;
}

/**
 * `GET <base_url>/gpu-hotplug/api/gpus[?kernel_id=K]` and every `metrics`
 * event of `GET .../stream` (`GpusJson`).
 */
export interface IGpusReply {
  mode: 'local' | 'kubernetes';
  kernel_id: string | null;
  attached: IAttachedGpu[];
  /**
   * GPUs nobody holds that "Attach N" may get now (`plain_attach`): whole GPUs,
   * never a GPU in MIG mode, slices only where the agent hands out their
   * profile alone.
   */
  free: number;
  /** The GPUs "Attach N" may get, free or not; `node` lists every GPU. */
  total: number;
  /** Every GPU of the node; absent from servers older than the GPU panel. */
  node?: INodeGpu[];
  /** This server's waiting attaches, first served first; absent from older servers. */
  queue?: IQueued[];
  /** The most GPUs one attach may ask for; absent from older servers. */
  max_count?: number;
  simulated: boolean;
  nvml: {
    status: string;
    message: string;
    driver_version: string | null;
    cuda_driver_version: string | null;
  };
  taken_at: number;
  /** GPUs the kernel lost lately, and why; absent from older servers. */
  released?: IReleasedGpu[];
  /** Which kernel of this server uses how much of each GPU; absent from older servers. */
  attribution?: IGpuAttribution[];
  /**
   * The kernel's CUDA state kept in host memory without its GPUs (a release
   * with keep); `null` while it is not suspended; absent from older servers.
   */
  suspended?: ISuspended | null;
}

/**
 * `_structs.SuspendedWire`, the agent's shape as `GpusJson.suspended` passes
 * it on: a kernel whose CUDA processes the agent checkpointed into host memory;
 * its next attach resumes them on GPUs of `model` (`uuids` first, when free).
 */
export interface ISuspended {
  /** `suspending` only while the suspend runs. */
  state: 'suspending' | 'suspended';
  model: string;
  uuids: string[];
  pids: number[];
  /** Bytes of device memory kept in host memory, when the driver says. */
  host_memory: number | null;
}

/** `UsageJson` (server/attribution.py): what a group of processes uses of one GPU. */
export interface IUsage {
  memory_bytes: number | null;
  sm_util_percent: number | null;
  processes: number;
}

/** `KernelUseJson`: one kernel's processes (it and its descendants) on one GPU. */
export interface IKernelUse extends IUsage {
  kernel_id: string;
  notebook: string | null;
}

/**
 * `GpuAttributionJson`: one GPU's processes by kernel of this server, and
 * what cannot be named (`GET .../attribution`, every reading's `attribution`).
 */
export interface IGpuAttribution {
  uuid: string;
  /** Most memory first. */
  kernels: IKernelUse[];
  /** Other processes of this notebook server; `null`: none. */
  server: IUsage | null;
  /** Processes the server sees that are not its own, as a sum only. */
  other_bytes: number | null;
  /** Processes whose pid the server cannot see (another pid namespace). */
  unattributed_bytes: number | null;
  unattributed_processes: number;
}

/** Why a GPU left a kernel (`ReleasedJson` of `server/releases.py`). */
export type ReleaseReason =
  'kernel_restarted' | 'idle' | 'detached_here' | 'detached_elsewhere';

/** One GPU a kernel lost lately, and why. */
export interface IReleasedGpu {
  uuid: string;
  index: number;
  reason: ReleaseReason;
  released_at: number;
}

/**
 * `GET <base_url>/gpu-hotplug/api/history` (`HistoryJson`, server/history.py):
 * per GPU UUID, readings `[taken_at, utilization_gpu, utilization_memory,
 * memory_used, memory_total, pcie_tx, pcie_rx, nvlink_tx, nvlink_rx]`, oldest
 * first (older servers send the first five).
 */
export interface IHistoryReply {
  seconds: number;
  columns: string[];
  gpus: {
    [uuid: string]: [
      number,
      number | null,
      number | null,
      number | null,
      number | null,
      (number | null)?,
      (number | null)?,
      (number | null)?,
      (number | null)?
    ][];
  };
}

/** `POST <base_url>/gpu-hotplug/api/attach` → 201 (`AttachJson`). */
export interface IAttachReply {
  request_id: string;
  kernel_id: string | null;
  attachments: Omit<IAttachedGpu, 'metrics'>[];
}

/** A process a `busy` error lists (`ProcessInfo` in _structs.py). */
export interface IBusyProcess {
  pid: number;
  command: string;
}

/**
 * Every error answer of the API, and the `error` event of the stream (which
 * adds `status`): `ErrorBody` (_structs.py) as `server/errors.py` writes it.
 */
export interface IErrorBody {
  error: string;
  message: string;
  reason?: string;
  retryable: boolean;
  status?: number;
  processes?: IBusyProcess[];
  free?: number;
  requested?: number;
}

/** A `progress` event of `GET .../stream` (`ProgressJson`). */
export interface IProgress {
  request_id: string;
  kernel_id: string | null;
  state: 'started' | 'waiting' | 'attached' | 'failed';
  count: number;
  elapsed: number;
  attachments?: Omit<IAttachedGpu, 'metrics'>[];
  error?: IErrorBody;
  /** While `waiting` in the agent's queue: 1 is served next… */
  position?: number;
  /** …of this many requests waiting on the node. */
  of?: number;
}
