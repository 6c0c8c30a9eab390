import { Signal } from '@lumino/signaling';

import { IKernelGpus } from '../src/gpuModel';
import {
  ILostHolderSource,
  LostHolderWarnings,
  lostHolderMessage
} from '../src/lostHolders';
import { IAttachedGpu } from '../src/types';
import { gpu as fixtureGpu, reply, trans } from './fixtures';

function gpu(change: Partial<IAttachedGpu> = {}): IAttachedGpu {
  return { ...fixtureGpu(0), ...change };
}

class Source implements ILostHolderSource {
  readonly changed = new Signal<this, string>(this);
  attached: IAttachedGpu[] = [];

  state(kernelId: string | null): IKernelGpus | null {
    return {
      kernelId: kernelId ?? '',
      reply: reply(this.attached),
      error: null,
      operation: null,
      connection: 'open',
      history: new Map()
    };
  }
}

const LOST = {
  reason: 'its holder pod ended (Evicted)',
  revoke_at: '2026-11-27T05:01:00Z'
};

describe('a GPU whose holder was lost', () => {
  it('is described with the reason and the device', () => {
    expect(lostHolderMessage(gpu(), trans)).toBeNull();
    const message = lostHolderMessage(gpu({ holder_lost: LOST }), trans);
    expect(message).toContain('/dev/nvidia0');
    expect(message).toContain('Evicted');
    expect(message).toContain('save your work');
  });

  it('is warned about once per announcement, from the live stream', () => {
    const source = new Source();
    const shown: string[] = [];
    const warnings = new LostHolderWarnings(source, trans, m => shown.push(m));
    source.changed.emit('k1');
    expect(shown).toEqual([]);
    source.attached = [gpu({ holder_lost: LOST })];
    source.changed.emit('k1');
    source.changed.emit('k1');
    expect(shown).toHaveLength(1);
    source.attached = [
      gpu({ holder_lost: { ...LOST, revoke_at: '2026-11-27T06:00:00Z' } })
    ];
    source.changed.emit('k1');
    expect(shown).toHaveLength(2);
    warnings.dispose();
    source.attached = [gpu({ uuid: 'GPU-1', holder_lost: LOST })];
    source.changed.emit('k1');
    expect(shown).toHaveLength(2);
  });
});
