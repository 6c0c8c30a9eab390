/**
 * What the frontend knows about the server extension. The model owns the
 * request and its outcome; views only render `state`, so a missing server
 * extension is decided in one place instead of in every widget.
 */
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { Endpoints } from './constants';
import { requestAPI } from './handler';
import { IVersionReply } from './types';

/** Where the model stands in finding the server extension. */
export type ServerState =
  | { readonly kind: 'loading' }
  | { readonly kind: 'ready'; readonly version: string }
  | { readonly kind: 'unavailable'; readonly reason: string };

/**
 * Asks the server extension for its version. A 404 or an unreachable server
 * means the Python side is not installed or not enabled, which the UI must
 * survive quietly: the state becomes `unavailable` rather than an error.
 */
export class ServerVersionModel {
  constructor(private readonly _request: typeof requestAPI = requestAPI) {}

  /** The latest known state; starts as `loading` until `refresh` settles. */
  get state(): ServerState {
    return this._state;
  }

  /** Emitted whenever `state` changes. */
  get stateChanged(): ISignal<this, void> {
    return this._stateChanged;
  }

  /** Ask the server again; never rejects, the outcome lands in `state`. */
  async refresh(): Promise<void> {
    this._setState(await this._fetch());
  }

  private async _fetch(): Promise<ServerState> {
    let reply: IVersionReply;
    try {
      reply = await this._request<IVersionReply>(Endpoints.version);
    } catch (error) {
      return { kind: 'unavailable', reason: describeFailure(error) };
    }
    if (typeof reply?.version !== 'string') {
      return {
        kind: 'unavailable',
        reason: 'the version endpoint answered without a "version" string'
      };
    }
    return { kind: 'ready', version: reply.version };
  }

  private _setState(state: ServerState): void {
    this._state = state;
    this._stateChanged.emit();
  }

  private _state: ServerState = { kind: 'loading' };
  private readonly _stateChanged = new Signal<this, void>(this);
}

/** A one-line reason for the tooltip and the debug log. */
function describeFailure(error: unknown): string {
  if (error instanceof ServerConnection.ResponseError) {
    return error.response.status === 404
      ? 'the jupyter_gpu_hotplug server extension is not installed or not enabled'
      : `the server answered ${error.response.status}: ${error.message}`;
  }
  if (error instanceof ServerConnection.NetworkError) {
    return `the server cannot be reached: ${error.message}`;
  }
  return String(error);
}
