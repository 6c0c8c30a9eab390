/**
 * What the toolbar item's menu offers, decided from the model's state alone,
 * so that the rules ("attach 1..N where N is free and allowed", "force-detach
 * only GPUs the kernel has") are tested without a DOM.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { CommandIds } from './constants';
import { IKernelGpus, IOperation, isUnreachable } from './gpuModel';

/** One item: a command, its arguments, and whether it can run now. */
export interface IMenuEntry {
  command: string;
  args: { [key: string]: string | number | boolean };
  label: string;
  enabled: boolean;
}

/** Items of the toolbar menu of the kernel whose state is `state`. */
export function menuEntries(
  state: IKernelGpus | null,
  trans: TranslationBundle
): IMenuEntry[] {
  const entries: IMenuEntry[] = [];
  const kernelId = state?.kernelId ?? '';
  const reply = state?.reply ?? null;
  const idle = state !== null && state.operation === null;
  const reachable = reply !== null && !isUnreachable(state);

  const free = reply?.free ?? 0;
  const allowed = Math.min(free, reply?.max_count ?? free);
  for (let count = 1; count <= allowed; count++) {
    entries.push({
      command: CommandIds.attach,
      args: { kernelId, count },
      label: trans._n('Attach %1 GPU', 'Attach %1 GPUs', count),
      enabled: idle && reachable
    });
  }
  if (state?.operation?.waiting && state.operation.kind === 'attach') {
    entries.push({
      command: CommandIds.cancelWait,
      args: { kernelId },
      label: trans.__('Stop waiting for a free GPU'),
      enabled: true
    });
  } else if (allowed === 0) {
    // Both modes can wait: the local agent's fair queue, or Kubernetes'
    // scheduler queueing the holder pod until a GPU frees up.
    entries.push({
      command: CommandIds.attach,
      args:
        reply === null
          ? { kernelId, count: 1 }
          : { kernelId, count: 1, wait: true },
      label:
        reply === null
          ? trans.__('Attach a GPU (GPU service not reachable)')
          : trans.__('Wait for a free GPU and attach it'),
      enabled: idle && reachable
    });
  }

  for (const gpu of reply?.attached ?? []) {
    entries.push({
      command: CommandIds.detach,
      args: { kernelId, uuid: gpu.uuid },
      label: trans.__('Detach GPU %1 (%2)', gpu.index, gpu.name),
      enabled: idle
    });
  }
  const attached = reply?.attached.length ?? 0;
  if (attached > 1) {
    entries.push({
      command: CommandIds.detachAll,
      args: { kernelId },
      label: trans.__('Detach all %1 GPUs', attached),
      enabled: idle
    });
  }
  for (const gpu of reply?.attached ?? []) {
    entries.push({
      command: CommandIds.forceDetach,
      args: { kernelId, uuid: gpu.uuid },
      label: trans.__('Force-detach GPU %1…', gpu.index),
      enabled: idle
    });
  }
  entries.push({
    command: CommandIds.openPanel,
    args: {},
    label: trans.__('Open the GPU panel'),
    enabled: true
  });
  return entries;
}

/** "Waiting for a free GPU… position 2 of 3" (the place when the server says it). */
export function waitingMessage(
  operation: IOperation | null,
  trans: TranslationBundle
): string {
  return operation?.position !== undefined && operation.of !== undefined
    ? trans.__(
        'Waiting for a free GPU… position %1 of %2',
        operation.position,
        operation.of
      )
    : trans.__('Waiting for a free GPU…');
}

/** The toolbar item's text: "GPU", "GPU ×2"; "GPU 2/3" while 2nd of 3 in the queue. */
export function buttonLabel(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  const operation = state?.operation;
  if (operation?.waiting && operation.position !== undefined) {
    return trans.__('GPU %1/%2', operation.position, operation.of ?? '?');
  }
  const count = state?.reply?.attached.length ?? 0;
  return count > 1 ? trans.__('GPU ×%1', count) : trans.__('GPU');
}

/** The toolbar item's accessible name and tooltip. */
export function buttonDescription(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  if (state === null) {
    return trans.__('GPUs: no kernel');
  }
  if (state.operation?.kind === 'attach') {
    const { waiting, position, of } = state.operation;
    if (waiting && position !== undefined && of !== undefined) {
      return trans.__(
        'GPUs: waiting for a free GPU… position %1 of %2',
        position,
        of
      );
    }
    return waiting
      ? trans.__('GPUs: waiting for a free GPU…')
      : trans.__('GPUs: attaching…');
  }
  if (state.operation?.kind === 'detach') {
    return trans.__('GPUs: detaching…');
  }
  if (isUnreachable(state)) {
    return trans.__('GPUs: the GPU service cannot be reached');
  }
  const count = state.reply?.attached.length ?? 0;
  const free = state.reply?.free ?? 0;
  return count === 0
    ? trans.__('GPUs: none attached to this kernel, %1 free', free)
    : trans._n(
        'GPUs: %1 attached to this kernel, %2 free',
        'GPUs: %1 attached to this kernel, %2 free',
        count,
        free
      );
}
