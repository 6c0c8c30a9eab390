/**
 * The part of `@jupyterlab/services` the tested modules use: `ServerConnection`
 * with a `makeRequest` each test programs (`jest.fn`).
 */
export namespace ServerConnection {
  export interface ISettings {
    baseUrl: string;
    token: string;
  }

  export function makeSettings(): ISettings {
    return { baseUrl: 'http://localhost:8888/base/', token: '' };
  }

  export const makeRequest = jest.fn<
    Promise<Response>,
    [string, RequestInit, ISettings]
  >();

  export class ResponseError extends Error {
    constructor(
      readonly response: Response,
      message = `Invalid response: ${response.status}`
    ) {
      super(message);
    }
  }

  export class NetworkError extends TypeError {
    constructor(original: TypeError) {
      super(original.message);
    }
  }
}

export namespace Kernel {
  export type IKernelConnection = unknown;
}
