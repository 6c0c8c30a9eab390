/**
 * The part of `@jupyterlab/apputils` that `commands.ts` uses: notifications
 * and dialogs as `jest.fn`s the tests read back.
 */
export namespace Notification {
  export const emit = jest.fn((..._args: unknown[]) => 'note-1');
  export const update = jest.fn((..._args: unknown[]) => true);
  export const dismiss = jest.fn((..._args: unknown[]) => undefined);
  export const info = jest.fn((..._args: unknown[]) => 'note-info');
  export const error = jest.fn((..._args: unknown[]) => 'note-error');
  export const warning = jest.fn((..._args: unknown[]) => 'note-warning');
}

export const showDialog = jest.fn();

export const Dialog = {
  cancelButton: (options: object) => ({ ...options, accept: false }),
  warnButton: (options: object) => ({ ...options, accept: true })
};
