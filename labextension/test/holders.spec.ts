import { holderLabel, stateLabel } from '../src/holders';
import { INodeGpu } from '../src/types';
import { trans } from './fixtures';

function nodeGpu(change: Partial<INodeGpu>): INodeGpu {
  return {
    uuid: 'GPU-0',
    index: 0,
    minor: 0,
    name: 'NVIDIA H100 80GB HBM3 (simulated)',
    memory_total: 80 * 1024 ** 3,
    state: 'attached',
    mine: false,
    ...change
  };
}

describe('the panel names who holds a GPU', () => {
  it('by notebook, kernel, pod or process', () => {
    expect(
      holderLabel(
        { kind: 'notebook', name: 'team/other.ipynb', kernel_id: 'k2' },
        trans
      )
    ).toBe('team/other.ipynb');
    expect(
      holderLabel({ kind: 'pod', name: 'ns/name', kernel_id: null }, trans)
    ).toBe('pod ns/name');
    expect(
      holderLabel({ kind: 'kernel', name: 'kernel k3', kernel_id: 'k3' }, trans)
    ).toBe('kernel k3');
    expect(holderLabel(null, trans)).toBeNull();
    expect(holderLabel(undefined, trans)).toBeNull();
  });

  it('in the state of each GPU of the node', () => {
    const notebook = {
      kind: 'notebook' as const,
      name: 'team/other.ipynb',
      kernel_id: 'k2'
    };
    expect(stateLabel(nodeGpu({ held_by: notebook }), trans)).toBe(
      'held by team/other.ipynb'
    );
    expect(stateLabel(nodeGpu({ mine: true, held_by: notebook }), trans)).toBe(
      'this notebook'
    );
    expect(stateLabel(nodeGpu({}), trans)).toBe('another kernel or pod');
    expect(stateLabel(nodeGpu({ state: 'free', held_by: null }), trans)).toBe(
      'free'
    );
    const pod = { kind: 'pod' as const, name: 'ns/trainer', kernel_id: null };
    expect(
      stateLabel(nodeGpu({ state: 'allocated', held_by: pod }), trans)
    ).toBe('allocated by the scheduler to pod ns/trainer');
  });
});
