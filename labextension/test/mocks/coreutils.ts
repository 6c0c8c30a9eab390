/** `URLExt.join` of `@jupyterlab/coreutils`, enough for the request helper. */
export namespace URLExt {
  export function join(...parts: string[]): string {
    return parts
      .map((part, i) =>
        i === 0 ? part.replace(/\/+$/, '') : part.replace(/^\/+|\/+$/g, '')
      )
      .join('/');
  }
}
