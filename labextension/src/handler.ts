/**
 * The one way the frontend talks to the server extension. Every REST call goes
 * through `requestAPI`, so authentication, base URL handling and error mapping
 * are done once: callers get a parsed body or one of the two `ServerConnection`
 * errors, never a half-read `Response`.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { API_NAMESPACE } from './constants';
import { IErrorBody } from './types';

/**
 * A `ResponseError` that keeps the server's JSON error body (`code`, the
 * processes of a `busy` GPU...), so callers can decide on the error's kind
 * without parsing its message.
 */
export class ApiError extends ServerConnection.ResponseError {
  constructor(
    response: Response,
    readonly body: IErrorBody | null
  ) {
    super(response, body?.message);
  }
}

/**
 * Call `<base_url>/gpu-hotplug/api/<endPoint>` and return the decoded JSON body.
 *
 * @throws {ServerConnection.NetworkError} when the server cannot be reached.
 * @throws {ApiError} (a `ServerConnection.ResponseError`) when the server
 *   answers with an error status: its JSON `message` becomes the error message,
 *   the whole body is `body`.
 * @throws {ServerConnection.ResponseError} when the body is not JSON.
 */
export async function requestAPI<T>(
  endPoint: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = apiUrl(endPoint, settings);

  // Not JupyterLab's default `no-store`: for it `makeRequest` adds a cache
  // buster (`&<timestamp>`) to the query, which our API rejects as an unknown
  // parameter. `no-cache` still revalidates every time.
  const request: RequestInit = { cache: 'no-cache', ...init };
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, request, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }

  const text = await response.text();
  let body: unknown = null;
  if (text.length > 0) {
    try {
      body = JSON.parse(text);
    } catch {
      throw new ServerConnection.ResponseError(
        response,
        `${url} answered ${response.status} with a body that is not JSON`
      );
    }
  }

  if (!response.ok) {
    throw new ApiError(response, asErrorBody(body));
  }
  return body as T;
}

/** `body` if it is a jupyter_server JSON error body (it has a `message`). */
function asErrorBody(body: unknown): IErrorBody | null {
  if (typeof body === 'object' && body !== null && 'message' in body) {
    const message = (body as { message: unknown }).message;
    if (typeof message === 'string') {
      return { error: 'error', retryable: false, ...body } as IErrorBody;
    }
  }
  return null;
}

/**
 * What went wrong, as the server said it (never a stack): the error body of
 * an `ApiError`, or one made up for a network failure or anything else.
 */
export function describeError(error: unknown): IErrorBody {
  if (error instanceof ApiError && error.body !== null) {
    return { ...error.body, status: error.response.status };
  }
  if (error instanceof ServerConnection.ResponseError) {
    return {
      error: 'http_error',
      message: error.message,
      retryable: false,
      status: error.response.status
    };
  }
  if (error instanceof ServerConnection.NetworkError) {
    return {
      error: 'network_error',
      message: `The Jupyter server cannot be reached: ${error.message}`,
      retryable: true
    };
  }
  return {
    error: 'internal_error',
    message: error instanceof Error ? error.message : String(error),
    retryable: false
  };
}

/** The URL of an endpoint, for clients that cannot use `fetch` (`EventSource`). */
export function apiUrl(
  endPoint: string,
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): string {
  return URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);
}
