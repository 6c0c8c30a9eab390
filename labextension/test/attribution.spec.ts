import {
  AttributionList,
  attributionOf,
  attributionRows
} from '../src/attribution';
import { IGpuAttribution, IGpusReply } from '../src/types';
import { trans } from './fixtures';

const GIB = 1024 ** 3;

function entry(change: Partial<IGpuAttribution> = {}): IGpuAttribution {
  return {
    uuid: 'GPU-0',
    kernels: [
      {
        kernel_id: 'aaaaaaaa-1111-2222-3333-444444444444',
        notebook: 'work/train.ipynb',
        memory_bytes: 3 * GIB,
        sm_util_percent: 60,
        processes: 2
      },
      {
        kernel_id: 'bbbbbbbb-1111-2222-3333-444444444444',
        notebook: null,
        memory_bytes: null,
        sm_util_percent: null,
        processes: 1
      }
    ],
    server: null,
    other_bytes: null,
    unattributed_bytes: null,
    unattributed_processes: 0,
    ...change
  };
}

describe('the panel says which kernel uses a GPU', () => {
  it('names notebooks, else the kernel id, with memory and utilisation', () => {
    const rows = attributionRows(
      entry(),
      'aaaaaaaa-1111-2222-3333-444444444444',
      trans
    );
    expect(rows.map(r => [r.label, r.usage, r.current])).toEqual([
      ['train.ipynb', '3.0 GiB · 60 %', true],
      ['kernel bbbbbbbb', '', false]
    ]);
  });

  it('adds what it cannot name, never a pid', () => {
    const rows = attributionRows(
      entry({
        kernels: [],
        server: { memory_bytes: GIB, sm_util_percent: 5, processes: 1 },
        other_bytes: 2 * GIB,
        unattributed_bytes: 4 * GIB,
        unattributed_processes: 3
      }),
      null,
      trans
    );
    expect(rows.map(r => [r.label, r.usage])).toEqual([
      ['other processes of this notebook server', '1.0 GiB · 5 %'],
      ['processes outside this notebook server', '2.0 GiB'],
      ['unattributed (a process this server cannot see)', '4.0 GiB']
    ]);
    expect(rows.every(r => r.kernelId === null)).toBe(true);
  });

  it('finds the GPU in a reply, and nothing in an older server', () => {
    const reply = { attribution: [entry()] } as unknown as IGpusReply;
    expect(attributionOf(reply, 'GPU-0')?.kernels).toHaveLength(2);
    expect(attributionOf(reply, 'GPU-1')).toBeNull();
    expect(attributionOf({} as IGpusReply, 'GPU-0')).toBeNull();
    expect(attributionRows(null, null, trans)).toEqual([]);
  });

  it('highlights the current notebook in the list', () => {
    const list = new AttributionList(trans);
    list.update(entry(), 'bbbbbbbb-1111-2222-3333-444444444444');
    const current = list.node.querySelectorAll('[aria-current="true"]');
    expect(current).toHaveLength(1);
    expect(current[0].textContent).toContain('kernel bbbbbbbb (this notebook)');
    expect(list.node.hidden).toBe(false);
    list.update(null, null);
    expect(list.node.hidden).toBe(true);
  });
});
