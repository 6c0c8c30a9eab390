import {
  announcement,
  binaryBytes,
  bytesPerSecond,
  countdown,
  cudaIndex,
  gib,
  gpuTitle,
  keptState,
  memoryNearLimit,
  modelName,
  notebookName,
  rateUnit,
  shortUuid,
  statusSummary,
  suspendedLine,
  suspendedState
} from '../src/format';
import {
  gpu,
  kernelState as state,
  reply,
  suspension,
  trans
} from './fixtures';

describe('the status bar summary', () => {
  it('sums two GPUs: count, mean utilisation, memory used of total', () => {
    const two = state(reply([gpu(0, 70), gpu(1, 84)], { free: 0 }));
    expect(statusSummary(two, trans)).toBe('2 GPUs · 77 % · 16/160 GiB');
  });

  it('says how many are free when none is attached', () => {
    expect(statusSummary(state(reply([], { free: 2 })), trans)).toBe(
      '0 attached · 2 free'
    );
  });

  it('shows the queue place, and the disconnected state', () => {
    const waiting = state(reply([], { free: 0 }), {
      operation: { kind: 'attach', count: 1, waiting: true, position: 1, of: 1 }
    });
    expect(statusSummary(waiting, trans)).toBe('GPU: queued #1');
    const down = state(reply([]), { connection: 'reconnecting' });
    expect(statusSummary(down, trans)).toBe('GPU: disconnected');
  });
});

describe('the live announcement', () => {
  it('does not change with utilisation, only with the state', () => {
    const said = [10, 50, 90].map(u =>
      announcement(state(reply([gpu(0, u)], { free: 1 })), trans)
    );
    expect(new Set(said)).toEqual(new Set(['1 GPU attached']));
    expect(announcement(state(reply([], { free: 2 })), trans)).toBe(
      'No GPU attached, 2 free'
    );
  });

  it('mentions memory near its limit', () => {
    const full = gpu(0);
    full.metrics!.memory_used = 79 * 1024 ** 3;
    const s = state(reply([full], { free: 1 }));
    expect(memoryNearLimit(s)).toBe(true);
    expect(announcement(s, trans)).toBe(
      '1 GPU attached. GPU memory almost full'
    );
  });
});

describe('one GPU numbering', () => {
  it("gives the node's index, and the kernel's CUDA index where it differs", () => {
    const attached = [gpu(1), gpu(3)];
    expect(cudaIndex('GPU-3', attached)).toBe(1);
    expect(cudaIndex('GPU-0', attached)).toBeNull();
    expect(gpuTitle(gpu(3), attached, trans)).toBe(
      'GPU 3 (cuda:1 in this notebook)'
    );
    expect(gpuTitle(gpu(0), [gpu(0)], trans)).toBe('GPU 0');
    expect(gpuTitle(gpu(2), [], trans)).toBe('GPU 2');
  });
});

describe('formatters', () => {
  it('round GiB the same way everywhere', () => {
    expect(gib(79.6 * 1024 ** 3)).toBe('80');
    expect(gib(2.14 * 1024 ** 3)).toBe('2.1');
  });

  it('shorten UUIDs, name notebooks and models', () => {
    expect(shortUuid('GPU-1a2b3c4d-0000-1111-2222-333344445555')).toBe(
      'GPU-1a2b3c4d'
    );
    expect(notebookName('team/run.ipynb')).toBe('run.ipynb');
    expect(modelName('NVIDIA H100 80GB HBM3 (simulated)')).toBe(
      'NVIDIA H100 80GB HBM3'
    );
  });

  it('write rates in the decimal unit they reach (PCIe, NVLink)', () => {
    expect(bytesPerSecond(0)).toBe('0 B/s');
    expect(bytesPerSecond(640)).toBe('640 B/s');
    expect(bytesPerSecond(12_345_678)).toBe('12 MB/s');
    expect(bytesPerSecond(2_460_000_000)).toBe('2.5 GB/s');
    expect(rateUnit(999)).toEqual({ unit: 'B/s', size: 1 });
    expect(rateUnit(300e9)).toEqual({ unit: 'GB/s', size: 1e9 });
  });

  it('count down to a deadline', () => {
    expect(countdown(165, 100_000, trans)).toBe('1:05 left');
    expect(countdown(145, 100_000, trans)).toBe('45 s left');
    expect(countdown(90, 100_000, trans)).toBe('ending');
  });
});

describe('a suspended kernel (issue 39)', () => {
  it('is worded as %gpu status words it, the size where the driver says', () => {
    expect(suspendedState(suspension(), trans)).toBe(
      'suspended (state kept, 3.0 GiB in host memory)'
    );
    expect(suspendedState(suspension({ host_memory: null }), trans)).toBe(
      'suspended (state kept in host memory)'
    );
    expect(suspendedState(suspension({ state: 'suspending' }), trans)).toBe(
      'suspending (its CUDA state is being moved to host memory)'
    );
  });

  it('says that attaching resumes it, on how many GPUs of which model', () => {
    expect(suspendedLine(suspension(), trans)).toBe(
      "This notebook's kernel is suspended (state kept, 3.0 GiB in host memory); " +
        'attaching resumes it on 1 free NVIDIA H100 80GB HBM3 GPU (the same one when free).'
    );
    const two = suspension({ uuids: ['GPU-0', 'GPU-1'], host_memory: null });
    expect(suspendedLine(two, trans)).toBe(
      "This notebook's kernel is suspended (state kept in host memory); " +
        'attaching resumes it on 2 free NVIDIA H100 80GB HBM3 GPUs (the same ones when free).'
    );
  });

  it('shows in the status bar and its announcement while no GPU is attached', () => {
    const kept = state(reply([], { free: 2, suspended: suspension() }));
    expect(statusSummary(kept, trans)).toBe('GPU: suspended · 2 free');
    expect(announcement(kept, trans)).toBe(
      'No GPU attached, the kernel suspended in host memory, 2 free'
    );
    const moving = state(
      reply([], { suspended: suspension({ state: 'suspending' }) })
    );
    expect(statusSummary(moving, trans)).toBe('GPU: suspending…');
    expect(announcement(moving, trans)).toBe(
      'Suspending the kernel into host memory'
    );
  });

  it('is over once a GPU is attached again, and unknown to an older server', () => {
    const resumed = state(reply([gpu(0)], { suspended: suspension() }));
    expect(keptState(resumed)).toBeNull();
    expect(statusSummary(resumed, trans)).not.toContain('suspended');
    expect(keptState(state(reply([], { free: 2 })))).toBeNull();
    expect(keptState(null)).toBeNull();
  });

  it('sizes host memory in the unit it reaches, rounded as %gpu rounds', () => {
    expect(binaryBytes(512)).toBe('512 B');
    expect(binaryBytes(5 * 1024 ** 2)).toBe('5.0 MiB');
    expect(binaryBytes(3 * 1024 ** 3)).toBe('3.0 GiB');
    expect(binaryBytes(79.6 * 1024 ** 3)).toBe('80 GiB');
  });
});
