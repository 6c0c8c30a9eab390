import { CommandIds } from '../src/constants';
import { IKernelGpus } from '../src/gpuModel';
import {
  IMenuCommand,
  buttonDescription,
  buttonLabel,
  menuEntries,
  waitingMessage
} from '../src/menu';
import { IGpusReply, INodeGpu } from '../src/types';
import {
  gpu,
  node,
  kernelState as state,
  reply,
  suspension,
  trans
} from './fixtures';

const summary = (s: IKernelGpus | null) =>
  menuEntries(s, trans).map(e =>
    e.type === 'separator' ? '---' : `${e.label}${e.enabled ? '' : ' [off]'}`
  );

const commands = (s: IKernelGpus | null) =>
  menuEntries(s, trans).filter((e): e is IMenuCommand => e.type === 'command');

describe('menuEntries', () => {
  it('offers attach 1..N with N the free GPUs, and the panel', () => {
    expect(summary(state(reply([], { free: 3 })))).toEqual([
      'Attach 1 GPU',
      'Attach 2 GPUs',
      'Attach 3 GPUs',
      '---',
      'Open the GPU panel'
    ]);
  });

  it('never offers more than one request may ask for', () => {
    const entries = commands(state(reply([], { free: 6, maxCount: 2 })));
    expect(entries.filter(e => e.command === CommandIds.attach)).toHaveLength(
      2
    );
    expect(entries[1].args).toEqual({ kernelId: 'k1', count: 2 });
  });

  it.each(['local', 'kubernetes'] as const)(
    'with no free GPU in %s mode offers to wait for one',
    mode => {
      const queued = { ...reply([gpu(0)], { free: 0 }), mode };
      const entries = commands(state(queued));
      expect(entries[0]).toMatchObject({
        command: CommandIds.attach,
        args: { kernelId: 'k1', count: 1, wait: true },
        label: 'Wait for a free GPU and attach it',
        enabled: true
      });
    }
  );

  it('never offers a notebook that holds every GPU to wait for itself', () => {
    const all = state(reply([gpu(0), gpu(1)], { free: 0, total: 2 }));
    expect(summary(all).slice(0, 3)).toEqual([
      'This notebook has every GPU of the node [off]',
      '---',
      'Detach GPU 0'
    ]);
    expect(
      commands(all).some(e => e.args.wait === true || /Wait/.test(e.label))
    ).toBe(false);
  });

  describe('on a node with a GPU in MIG mode (the hub tier found it)', () => {
    // GPUs 0-3 whole, GPU 4 in MIG mode with two 1g.10gb slices: "Attach 1
    // GPU" can only ever get one of GPUs 0-3, so only they count as free.
    const slice = (n: number, mine: boolean): INodeGpu => ({
      ...node(4, mine),
      uuid: `MIG-${n}`,
      kind: 'mig_slice',
      plain_attach: false
    });
    const migNode = (mine: number[]): INodeGpu[] => [
      ...[0, 1, 2, 3].map(i => ({
        ...node(i, mine.includes(i)),
        state: 'attached' as const,
        kind: 'gpu' as const,
        plain_attach: true
      })),
      { ...node(4), kind: 'mig_parent', plain_attach: false },
      slice(1, mine.includes(41)),
      slice(2, false)
    ];
    const held = (mine: number[]): IGpusReply =>
      reply(
        migNode(mine)
          .filter(g => g.mine)
          .map(g => ({ ...gpu(g.index), uuid: g.uuid })),
        { free: 0, total: 4, node: migNode(mine) }
      );

    it('offers to wait when only MIG slices are free', () => {
      const entries = summary(state(held([])));
      expect(entries[0]).toBe('Wait for a free GPU and attach it');
      expect(entries.some(e => /^Attach \d/.test(e))).toBe(false);
      expect(buttonLabel(state(held([])), trans)).toBe('GPU · 0 free');
    });

    it('offers to wait to a notebook holding three whole GPUs and a slice', () => {
      // Four attachments, but one is a slice: the fourth whole GPU is someone
      // else's, so waiting for it is not waiting for itself.
      const entries = summary(state(held([0, 1, 2, 41])));
      expect(entries[0]).toBe('Wait for a free GPU and attach it');
    });

    it('says so to a notebook holding all four whole GPUs and a slice', () => {
      const entries = summary(state(held([0, 1, 2, 3, 41])));
      expect(entries[0]).toBe('This notebook has every GPU of the node [off]');
    });
  });

  it('shows a wait the page did not start, and offers to stop it (issue 36, item 5)', () => {
    const magic = state(
      reply([], {
        free: 0,
        queue: [
          {
            request_id: 'magic-1',
            kernel_id: 'k1',
            held_by: null,
            count: 1,
            position: 1,
            of: 2,
            deadline: null
          }
        ]
      })
    );
    expect(buttonLabel(magic, trans)).toBe('queued #1');
    expect(commands(magic)[0]).toMatchObject({
      command: CommandIds.cancelWait,
      args: { kernelId: 'k1', requestId: 'magic-1' },
      label: 'Stop waiting for a free GPU',
      enabled: true
    });
  });

  it('while waiting offers to stop waiting instead', () => {
    const waiting = state(reply([], { free: 0 }), {
      operation: {
        kind: 'attach',
        count: 1,
        waiting: true,
        requestId: 'r',
        position: 2,
        of: 3
      }
    });
    const entries = commands(waiting);
    expect(entries[0]).toMatchObject({
      command: CommandIds.cancelWait,
      args: { kernelId: 'k1' },
      label: 'Stop waiting for a free GPU',
      enabled: true
    });
    expect(summary(waiting)).toEqual([
      'Stop waiting for a free GPU',
      '---',
      'Open the GPU panel'
    ]);
  });

  it('detaches one, all, and force-detaches each GPU of the kernel', () => {
    const entries = menuEntries(
      state(reply([gpu(0), gpu(1)], { free: 0 })),
      trans
    );
    expect(
      entries.map(e =>
        e.type === 'separator' ? '---' : [e.command, e.args.uuid ?? null]
      )
    ).toEqual([
      [CommandIds.attach, null],
      '---',
      [CommandIds.detach, 'GPU-0'],
      [CommandIds.detach, 'GPU-1'],
      [CommandIds.detachAll, null],
      [CommandIds.releaseKeep, null],
      '---',
      [CommandIds.forceDetach, 'GPU-0'],
      [CommandIds.forceDetach, 'GPU-1'],
      '---',
      [CommandIds.openPanel, null]
    ]);
  });

  it('disables actions while one is in flight or the service is unreachable', () => {
    const busy = state(reply([gpu(0)], { free: 1 }), {
      operation: { kind: 'attach', count: 1, waiting: false }
    });
    expect(summary(busy)).toEqual([
      'Attach 1 GPU [off]',
      '---',
      'Detach GPU 0 [off]',
      "Release all, keep the kernel's state [off]",
      '---',
      'Force-detach GPU 0… [off]',
      '---',
      'Open the GPU panel'
    ]);
    const down = state(reply([], { free: 1 }), { connection: 'reconnecting' });
    expect(summary(down)[0]).toBe('Attach 1 GPU [off]');
  });

  it('without a reading says the service is not reachable', () => {
    expect(summary(state(null))).toEqual([
      'Attach a GPU (GPU service not reachable) [off]',
      '---',
      'Open the GPU panel'
    ]);
  });

  it("names GPUs by the node index, with the kernel's CUDA index where it differs", () => {
    expect(summary(state(reply([gpu(1)], { free: 0 })))).toContain(
      'Detach GPU 1 (cuda:0 in this notebook)'
    );
  });
});

describe('the toolbar button', () => {
  it('reads "GPU · N free", "GPU", then "GPU ×N"', () => {
    expect(buttonLabel(null, trans)).toBe('GPU');
    expect(buttonLabel(state(reply([], { free: 2 })), trans)).toBe(
      'GPU · 2 free'
    );
    expect(buttonLabel(state(reply([gpu(0)])), trans)).toBe('GPU');
    expect(buttonLabel(state(reply([gpu(0), gpu(1)])), trans)).toBe('GPU ×2');
  });

  it('shows the place in the queue while waiting', () => {
    const operation = {
      kind: 'attach' as const,
      count: 1,
      waiting: true,
      position: 2,
      of: 3
    };
    const waiting = state(reply([]), { operation });
    expect(buttonLabel(waiting, trans)).toBe('queued #2');
    expect(buttonDescription(waiting, trans)).toBe(
      'GPUs: waiting for a free GPU… position 2 of 3'
    );
    expect(waitingMessage(operation, trans)).toBe(
      'Waiting for a free GPU… position 2 of 3'
    );
    const unplaced = { ...operation, position: undefined, of: undefined };
    expect(waitingMessage(unplaced, trans)).toBe('Waiting for a free GPU…');
    expect(buttonLabel(state(reply([]), { operation: unplaced }), trans)).toBe(
      'waiting'
    );
  });

  it('has an accessible name for every state', () => {
    expect(buttonDescription(state(reply([], { free: 2 })), trans)).toBe(
      'GPUs: none attached to this notebook, 2 free'
    );
    expect(buttonDescription(state(reply([gpu(0)], { free: 1 })), trans)).toBe(
      'GPUs: 1 attached to this notebook, 1 free'
    );
    const waiting = state(null, {
      operation: { kind: 'attach', count: 1, waiting: true }
    });
    expect(buttonDescription(waiting, trans)).toBe(
      'GPUs: waiting for a free GPU…'
    );
    const down = state(null, {
      error: {
        error: 'agent_unavailable',
        message: 'x',
        retryable: true,
        status: 503
      }
    });
    expect(buttonDescription(down, trans)).toBe(
      'GPUs: the GPU service cannot be reached'
    );
  });
});

describe('the toolbar button of a suspended kernel (issue 39)', () => {
  it('says suspended, and in its tooltip that attaching resumes it', () => {
    const kept = state(reply([], { free: 2, suspended: suspension() }));
    expect(buttonLabel(kept, trans)).toBe('GPU · suspended');
    expect(buttonDescription(kept, trans)).toBe(
      'GPUs: none attached to this notebook, 2 free. ' +
        "This notebook's kernel is suspended (state kept, 3.0 GiB in host memory); " +
        'attaching resumes it on 1 free NVIDIA H100 80GB HBM3 GPU (the same one when free).'
    );
  });

  it('says suspending while the suspend runs', () => {
    const moving = suspension({ state: 'suspending' });
    expect(buttonLabel(state(reply([], { suspended: moving })), trans)).toBe(
      'GPU · suspending…'
    );
  });

  it('reads as before once resumed, and with an older server', () => {
    expect(buttonLabel(state(reply([], { suspended: null })), trans)).toBe(
      'GPU · 2 free'
    );
    expect(
      buttonLabel(state(reply([gpu(0)], { suspended: null })), trans)
    ).toBe('GPU');
    expect(buttonLabel(state(reply([], { free: 1 })), trans)).toBe(
      'GPU · 1 free'
    );
  });

  it('offers a release that keeps the state, but not in Kubernetes mode', () => {
    const labels = (mode: 'local' | 'kubernetes') =>
      menuEntries(
        state({ ...reply([gpu(0)], { free: 1 }), mode }),
        trans
      ).flatMap(entry => (entry.type === 'command' ? [entry.command] : []));
    expect(labels('local')).toContain(CommandIds.releaseKeep);
    expect(labels('kubernetes')).not.toContain(CommandIds.releaseKeep);
  });

  it('offers one resume, on as many GPUs as it had, in place of "Attach N"', () => {
    const two = suspension({ uuids: ['GPU-0', 'GPU-1'] });
    const kept = state(reply([], { free: 2, suspended: two }));
    const commands = menuEntries(kept, trans).flatMap(entry =>
      entry.type === 'command' ? [entry] : []
    );
    expect(commands.map(entry => entry.label)).toEqual([
      'Resume on 2 GPUs',
      'Open the GPU panel'
    ]);
    expect(commands[0]).toMatchObject({
      command: CommandIds.attach,
      args: { kernelId: 'k1', count: 2 },
      enabled: true
    });
  });

  it('offers nothing to run while the suspend itself runs', () => {
    const moving = suspension({ state: 'suspending' });
    const [first] = menuEntries(
      state(reply([], { free: 2, suspended: moving })),
      trans
    );
    expect(first).toMatchObject({
      label: 'Suspending into host memory…',
      enabled: false
    });
  });

  it('offers the resume even with no GPU free: the agent answers why not', () => {
    const kept = state(reply([], { free: 0, suspended: suspension() }));
    const labels = menuEntries(kept, trans).flatMap(entry =>
      entry.type === 'command' ? [entry.label] : []
    );
    expect(labels).toEqual(['Resume on 1 GPU', 'Open the GPU panel']);
  });
});
