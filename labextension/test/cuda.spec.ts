import { Kernel } from '@jupyterlab/services';

import { cudaAlreadyInitialised } from '../src/cuda';

function kernel(
  reply: unknown,
  seen: unknown[] = []
): Kernel.IKernelConnection {
  return {
    requestExecute: (content: unknown) => {
      seen.push(content);
      return { done: Promise.resolve(reply) };
    }
  } as unknown as Kernel.IKernelConnection;
}

const answer = (status: string, text?: string) => ({
  content: {
    status: 'ok',
    user_expressions: {
      cuda: { status, data: text === undefined ? {} : { 'text/plain': text } }
    }
  }
});

describe('cudaAlreadyInitialised', () => {
  it('asks the kernel silently, through the kernel side’s own detection', async () => {
    const seen: unknown[] = [];
    expect(
      await cudaAlreadyInitialised(kernel(answer('ok', 'True'), seen))
    ).toBe(true);
    expect(seen).toEqual([
      {
        code: '',
        silent: true,
        store_history: false,
        user_expressions: {
          cuda: expect.stringContaining('jupyter_gpu_hotplug.kernel.cuda')
        }
      }
    ]);
  });

  it('says no, or cannot tell when the kernel lacks the package or fails', async () => {
    expect(await cudaAlreadyInitialised(kernel(answer('ok', 'False')))).toBe(
      false
    );
    expect(await cudaAlreadyInitialised(kernel(answer('error')))).toBeNull();
    const broken = {
      requestExecute: () => ({ done: Promise.reject(new Error('dead')) })
    } as unknown as Kernel.IKernelConnection;
    expect(await cudaAlreadyInitialised(broken)).toBeNull();
  });
});
