/**
 * The one way the frontend talks to the server extension. Every REST call goes
 * through `requestAPI`, so authentication, base URL handling and error mapping
 * are done once: callers get a parsed body or one of the two `ServerConnection`
 * errors, never a half-read `Response`.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { API_NAMESPACE } from './constants';

/**
 * Call `<base_url>/gpu-hotplug/api/<endPoint>` and return the decoded JSON body.
 *
 * @throws {ServerConnection.NetworkError} when the server cannot be reached.
 * @throws {ServerConnection.ResponseError} when the server answers with an
 *   error status (its JSON `message` becomes the error message) or with a body
 *   that is not JSON.
 */
export async function requestAPI<T>(
  endPoint: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, API_NAMESPACE, endPoint);

  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
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
    throw new ServerConnection.ResponseError(response, errorMessage(body));
  }
  return body as T;
}

/** The `message` of a jupyter_server JSON error body, if it has one. */
function errorMessage(body: unknown): string | undefined {
  if (typeof body === 'object' && body !== null && 'message' in body) {
    const message = (body as { message: unknown }).message;
    return typeof message === 'string' ? message : undefined;
  }
  return undefined;
}
