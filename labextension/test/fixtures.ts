/** Readings and responses shaped like the server's (see `src/types.ts`). */
import { IKernelGpus } from '../src/gpuModel';
import { IGpuSettings } from '../src/settings';
import { IAttachedGpu, IGpusReply, INodeGpu, ISuspended } from '../src/types';

/** Settings for the tests (the product's defaults live in `schema/plugin.json`). */
export const settings: IGpuSettings = {
  defaultCount: 1,
  confirmDetach: true,
  stream: true,
  chartMinutes: 2,
  waitSeconds: 120
};

export function gpu(index: number, utilization = 10): IAttachedGpu {
  return {
    uuid: `GPU-${index}`,
    index,
    minor: index,
    name: 'NVIDIA H100 80GB HBM3 (simulated)',
    device: `/dev/nvidia${index}`,
    target: { pid: 4242 },
    holder: null,
    attached_at: '2026-11-24T00:00:00Z',
    metrics: {
      utilization_gpu: utilization,
      utilization_memory: 5,
      memory_used: 8 * 1024 ** 3,
      memory_total: 80 * 1024 ** 3,
      temperature: 40,
      power_draw: 100,
      power_limit: 700,
      processes: [{ pid: 77, name: 'python', used_memory: 1024 }],
      lost: false
    }
  };
}

/** GPU `index` of the node; `mine`: the kernel's own. */
export function node(index: number, mine = false, utilization = 10): INodeGpu {
  const attached = gpu(index, utilization);
  return {
    uuid: attached.uuid,
    index,
    minor: index,
    name: attached.name,
    memory_total: 80 * 1024 ** 3,
    state: mine ? 'attached' : 'free',
    mine,
    held_by: null,
    metrics: attached.metrics
  };
}

export function reply(
  attached: IAttachedGpu[],
  {
    free = 2,
    total = 2,
    maxCount = 8,
    node = [] as INodeGpu[],
    queue = [] as IGpusReply['queue'],
    released = undefined as IGpusReply['released'],
    suspended = undefined as IGpusReply['suspended']
  } = {}
): IGpusReply {
  return {
    mode: 'local',
    kernel_id: 'k1',
    attached,
    free,
    total,
    node,
    queue,
    ...(released === undefined ? {} : { released }),
    ...(suspended === undefined ? {} : { suspended }),
    max_count: maxCount,
    simulated: true,
    nvml: {
      status: 'ok',
      message: '',
      driver_version: null,
      cuda_driver_version: null
    },
    taken_at: 0
  };
}

/** A kernel whose CUDA state the agent keeps in host memory (issue 39). */
export function suspension(over: Partial<ISuspended> = {}): ISuspended {
  return {
    state: 'suspended',
    model: 'NVIDIA H100 80GB HBM3 (simulated)',
    uuids: ['GPU-0'],
    pids: [4242],
    host_memory: 3 * 1024 ** 3,
    ...over
  };
}

/** A `fetch` response with a JSON body. */
export function response(status: number, body: unknown): Response {
  const text = body === null ? '' : JSON.stringify(body);
  return {
    ok: status >= 200 && status < 300,
    status,
    text: async () => text
  } as unknown as Response;
}

/** A `TranslationBundle` that only fills in `%1`, `%2`… (like the null translator). */
function fill(text: string, args: unknown[]): string {
  return text.replace(/%(\d+)/g, (_, n) => String(args[Number(n) - 1]));
}

export const trans = {
  __: (text: string, ...args: unknown[]) => fill(text, args),
  _n: (one: string, many: string, n: number, ...args: unknown[]) =>
    fill(n === 1 ? one : many, [n, ...args])
} as unknown as import('@jupyterlab/translation').TranslationBundle;

/** A watched kernel's state with the reading `r` (and `change` on top). */
export function kernelState(
  r: IGpusReply | null,
  change: Partial<IKernelGpus> = {}
): IKernelGpus {
  return {
    kernelId: 'k1',
    reply: r,
    error: null,
    operation: null,
    connection: 'open',
    history: new Map(),
    ...change
  };
}
