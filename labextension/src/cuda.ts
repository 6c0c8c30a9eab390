/**
 * After an attach: has CUDA already started in the kernel? If so, the kernel
 * will not see the new GPU (a process keeps the GPU list CUDA gave it), and
 * the success notification says what to do. The kernel is asked silently,
 * through a user expression that uses the kernel side's own detection
 * (`jupyter_gpu_hotplug.kernel.cuda`), so no output or history is left.
 */
import { Kernel } from '@jupyterlab/services';

const EXPRESSION =
  "__import__('jupyter_gpu_hotplug.kernel.cuda', fromlist=['cuda_initialised'])" +
  '.cuda_initialised().initialised';

/** `true`/`false` as the kernel answers; `null` if it cannot tell. */
export async function cudaAlreadyInitialised(
  kernel: Kernel.IKernelConnection
): Promise<boolean | null> {
  try {
    const reply = await kernel.requestExecute({
      code: '',
      silent: true,
      store_history: false,
      user_expressions: { cuda: EXPRESSION }
    }).done;
    const content = reply.content as {
      user_expressions?: {
        cuda?: { status: string; data?: { 'text/plain'?: string } };
      };
    };
    const answer = content.user_expressions?.cuda;
    if (answer?.status !== 'ok') {
      return null;
    }
    return answer.data?.['text/plain'] === 'True';
  } catch {
    return null;
  }
}
