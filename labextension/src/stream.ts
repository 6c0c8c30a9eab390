/**
 * The client of the server extension's live stream (server-sent events): one
 * `EventSource` per watched kernel, decoded into typed callbacks, reconnected
 * with exponential backoff when it breaks.
 *
 * Why our own reconnect: an `EventSource` retries by itself only while the
 * connection drops mid-stream; an HTTP error (the server restarting, a proxy
 * answering 502) closes it for good. Here every failure closes the source and
 * a new one is opened after 1, 2, 4 … up to `maxDelayMs`; the first event of
 * a new connection resets the delay.
 */
import { IDisposable } from '@lumino/disposable';

import { IErrorBody, IGpusReply, IProgress } from './types';

/** What the stream tells its owner. */
export interface IStreamHandlers {
  metrics(reply: IGpusReply): void;
  progress(progress: IProgress): void;
  /** An `error` event: the server could not read the GPUs this time. */
  error(body: IErrorBody): void;
  /** The connection itself: open, or broken and waiting to reconnect. */
  connection(state: 'open' | 'reconnecting'): void;
}

/** The parts of `EventSource` the client uses (tests pass a fake). */
export interface IEventSourceLike {
  addEventListener(type: string, listener: (event: MessageEvent) => void): void;
  close(): void;
  onopen: ((event: Event) => void) | null;
  onerror: ((event: Event) => void) | null;
}

/** The timers the client uses (tests pass fake ones). */
export interface ITimers {
  setTimeout(callback: () => void, ms: number): unknown;
  clearTimeout(handle: unknown): void;
}

export interface IStreamOptions {
  url: string;
  handlers: IStreamHandlers;
  open?: (url: string) => IEventSourceLike;
  timers?: ITimers;
  initialDelayMs?: number;
  maxDelayMs?: number;
}

const defaultTimers: ITimers = {
  setTimeout: (callback, ms) => window.setTimeout(callback, ms),
  clearTimeout: handle => window.clearTimeout(handle as number)
};

/** One live stream; starts at construction, ends at `dispose()`. */
export class GpuStream implements IDisposable {
  constructor(options: IStreamOptions) {
    this._url = options.url;
    this._handlers = options.handlers;
    this._open = options.open ?? (url => new EventSource(url));
    this._timers = options.timers ?? defaultTimers;
    this._initialDelayMs = options.initialDelayMs ?? 1000;
    this._maxDelayMs = options.maxDelayMs ?? 30000;
    this._connect();
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Failed connections since the last event (0 while healthy). */
  get failures(): number {
    return this._failures;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._source?.close();
    this._source = null;
    if (this._retry !== null) {
      this._timers.clearTimeout(this._retry);
      this._retry = null;
    }
  }

  private _connect(): void {
    this._retry = null;
    const source = this._open(this._url);
    this._source = source;
    source.onopen = () => this._handlers.connection('open');
    source.onerror = () => this._broken(source);
    source.addEventListener('metrics', event =>
      this._receive(event, data => this._handlers.metrics(data as IGpusReply))
    );
    source.addEventListener('progress', event =>
      this._receive(event, data => this._handlers.progress(data as IProgress))
    );
    source.addEventListener('error', event => {
      // Also fired (without data) when the connection fails: `onerror` handles that.
      if (typeof (event as MessageEvent).data === 'string') {
        this._receive(event, data => this._handlers.error(data as IErrorBody));
      }
    });
  }

  private _receive(
    event: MessageEvent,
    deliver: (data: unknown) => void
  ): void {
    if (this._disposed) {
      return;
    }
    this._failures = 0;
    let data: unknown;
    try {
      data = JSON.parse(event.data as string);
    } catch {
      return; // not ours to show: a proxy's page; the next event will do
    }
    deliver(data);
  }

  private _broken(source: IEventSourceLike): void {
    source.close();
    if (this._disposed || source !== this._source) {
      return;
    }
    this._source = null;
    const delay = Math.min(
      this._maxDelayMs,
      this._initialDelayMs * 2 ** Math.min(this._failures, 16)
    );
    this._failures += 1;
    this._handlers.connection('reconnecting');
    this._retry = this._timers.setTimeout(() => this._connect(), delay);
  }

  private readonly _url: string;
  private readonly _handlers: IStreamHandlers;
  private readonly _open: (url: string) => IEventSourceLike;
  private readonly _timers: ITimers;
  private readonly _initialDelayMs: number;
  private readonly _maxDelayMs: number;
  private _source: IEventSourceLike | null = null;
  private _retry: unknown = null;
  private _failures = 0;
  private _disposed = false;
}
