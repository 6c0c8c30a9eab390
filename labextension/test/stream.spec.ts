import {
  GpuStream,
  IEventSourceLike,
  IStreamHandlers,
  ITimers
} from '../src/stream';
import { gpu, reply } from './fixtures';

class FakeSource implements IEventSourceLike {
  constructor(readonly url: string) {}
  listeners = new Map<string, (event: MessageEvent) => void>();
  onopen: ((event: Event) => void) | null = null;
  onerror: ((event: Event) => void) | null = null;
  closed = false;
  addEventListener(
    type: string,
    listener: (event: MessageEvent) => void
  ): void {
    this.listeners.set(type, listener);
  }
  close(): void {
    this.closed = true;
  }
  emit(type: string, data: unknown): void {
    this.listeners.get(type)!({ data: JSON.stringify(data) } as MessageEvent);
  }
}

class FakeTimers implements ITimers {
  pending: { callback: () => void; ms: number }[] = [];
  setTimeout(callback: () => void, ms: number): unknown {
    const timer = { callback, ms };
    this.pending.push(timer);
    return timer;
  }
  clearTimeout(handle: unknown): void {
    this.pending = this.pending.filter(timer => timer !== handle);
  }
  fire(): number {
    const timer = this.pending.shift()!;
    timer.callback();
    return timer.ms;
  }
}

function setUp() {
  const sources: FakeSource[] = [];
  const timers = new FakeTimers();
  const seen: string[] = [];
  const handlers: IStreamHandlers = {
    metrics: r => seen.push(`metrics:${r.attached.length}`),
    progress: p => seen.push(`progress:${p.state}`),
    error: e => seen.push(`error:${e.error}`),
    connection: c => seen.push(`connection:${c}`)
  };
  const stream = new GpuStream({
    url: 'http://x/stream?kernel_id=k1',
    handlers,
    timers,
    open: url => {
      const source = new FakeSource(url);
      sources.push(source);
      return source;
    },
    initialDelayMs: 1000,
    maxDelayMs: 5000
  });
  return { stream, sources, timers, seen };
}

describe('GpuStream', () => {
  it('decodes each kind of event into its handler', () => {
    const { sources, seen } = setUp();
    const [source] = sources;
    source.onopen!(new Event('open'));
    source.emit('metrics', reply([gpu(0)]));
    source.emit('progress', { state: 'waiting' });
    source.emit('error', {
      error: 'agent_unavailable',
      message: 'No GPU agent'
    });
    expect(source.url).toBe('http://x/stream?kernel_id=k1');
    expect(seen).toEqual([
      'connection:open',
      'metrics:1',
      'progress:waiting',
      'error:agent_unavailable'
    ]);
  });

  it('reconnects with exponential backoff, reset by the first event', () => {
    const { sources, timers, seen } = setUp();
    const delays: number[] = [];
    for (let i = 0; i < 5; i++) {
      sources[sources.length - 1].onerror!(new Event('error'));
      expect(sources[sources.length - 1].closed).toBe(true);
      delays.push(timers.fire());
    }
    expect(delays).toEqual([1000, 2000, 4000, 5000, 5000]);
    expect(sources).toHaveLength(6);
    expect(seen.filter(s => s === 'connection:reconnecting')).toHaveLength(5);

    sources[5].emit('metrics', reply([]));
    sources[5].onerror!(new Event('error'));
    expect(timers.fire()).toBe(1000);
  });

  it('a connection failure without data is not an error event', () => {
    const { sources, seen } = setUp();
    sources[0].listeners.get('error')!({} as MessageEvent);
    expect(seen).toEqual([]);
  });

  it('dispose closes the source and cancels a pending reconnect', () => {
    const { stream, sources, timers } = setUp();
    sources[0].onerror!(new Event('error'));
    expect(timers.pending).toHaveLength(1);
    stream.dispose();
    expect(timers.pending).toHaveLength(0);
    expect(stream.isDisposed).toBe(true);
    expect(sources).toHaveLength(1);
  });
});
