/**
 * What the toolbar item's menu offers, decided from the model's state alone,
 * so that the rules ("attach 1..N where N is free and allowed", "force-detach
 * only GPUs the kernel has") are tested without a DOM. Groups are separated:
 * attach, detach, force-detach (destructive), the panel.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { CommandIds } from './constants';
import { gpuTitle, keptState, queuedLabel, suspendedLine } from './format';
import { IKernelGpus, IOperation, isUnreachable } from './gpuModel';
import { IGpusReply } from './types';

/** One item: a command, its arguments, and whether it can run now. */
export interface IMenuCommand {
  type: 'command';
  command: string;
  args: { [key: string]: string | number | boolean };
  label: string;
  enabled: boolean;
}

/** A line between groups of items. */
export interface IMenuSeparator {
  type: 'separator';
}

export type IMenuEntry = IMenuCommand | IMenuSeparator;

/**
 * The GPUs the kernel holds of the kind `free` and `total` count, those
 * "Attach N" gets (`plain_attach`): a MIG slice it holds through `%gpu attach
 * --mig` is not one. A server without `node`, or without `plain_attach` in it,
 * lists only such GPUs.
 */
function plainAttached(reply: IGpusReply): number {
  const others = new Set(
    (reply.node ?? [])
      .filter(gpu => gpu.plain_attach === false)
      .map(gpu => gpu.uuid)
  );
  return reply.attached.filter(gpu => !others.has(gpu.uuid)).length;
}

/** Items of the toolbar menu of the kernel whose state is `state`. */
export function menuEntries(
  state: IKernelGpus | null,
  trans: TranslationBundle
): IMenuEntry[] {
  const groups: IMenuCommand[][] = [[], [], [], []];
  const [attaching, detaching, forcing, other] = groups;
  const kernelId = state?.kernelId ?? '';
  const reply = state?.reply ?? null;
  const idle = state !== null && state.operation === null;
  const reachable = reply !== null && !isUnreachable(state);
  const command = (
    id: string,
    args: IMenuCommand['args'],
    label: string,
    enabled: boolean
  ): IMenuCommand => ({ type: 'command', command: id, args, label, enabled });

  const free = reply?.free ?? 0;
  const allowed = Math.min(free, reply?.max_count ?? free);
  const attached = reply?.attached ?? [];
  // Waiting would mean waiting for itself: no GPU "Attach N" may get that this
  // notebook lacks exists (a MIG slice it holds is not one of `total`).
  const holdsAll =
    reply !== null && reply.total > 0 && plainAttached(reply) >= reply.total;
  // A suspended kernel's attach is its resume, on as many GPUs as it had
  // (whatever the count asks): one offer that says so, never "Attach N".
  const kept = keptState(state);
  const offers = kept === null ? allowed : 0;
  for (let count = 1; count <= offers; count++) {
    attaching.push(
      command(
        CommandIds.attach,
        { kernelId, count },
        trans._n('Attach %1 GPU', 'Attach %1 GPUs', count),
        idle && reachable
      )
    );
  }
  const queued = (reply?.queue ?? []).find(
    entry => entry.kernel_id === kernelId && kernelId !== ''
  );
  if (state?.operation?.waiting && state.operation.kind === 'attach') {
    attaching.push(
      command(
        CommandIds.cancelWait,
        { kernelId },
        trans.__('Stop waiting for a free GPU'),
        true
      )
    );
  } else if (queued !== undefined && state?.operation === null) {
    // Waiting through %gpu attach --wait or the command line.
    attaching.push(
      command(
        CommandIds.cancelWait,
        { kernelId, requestId: queued.request_id },
        trans.__('Stop waiting for a free GPU'),
        true
      )
    );
  } else if (kept !== null) {
    const count = kept.uuids.length;
    attaching.push(
      kept.state === 'suspending'
        ? command(
            CommandIds.attach,
            { kernelId, count },
            trans.__('Suspending into host memory…'),
            false
          )
        : command(
            CommandIds.attach,
            { kernelId, count },
            trans._n('Resume on %1 GPU', 'Resume on %1 GPUs', count),
            idle && reachable
          )
    );
  } else if (allowed === 0 && holdsAll) {
    attaching.push(
      command(
        CommandIds.attach,
        { kernelId, count: 1 },
        trans.__('This notebook has every GPU of the node'),
        false
      )
    );
  } else if (allowed === 0) {
    // Both modes can wait: the local agent's fair queue, or Kubernetes'
    // scheduler queueing the holder pod until a GPU frees up.
    attaching.push(
      command(
        CommandIds.attach,
        reply === null
          ? { kernelId, count: 1 }
          : { kernelId, count: 1, wait: true },
        reply === null
          ? trans.__('Attach a GPU (GPU service not reachable)')
          : trans.__('Wait for a free GPU and attach it'),
        idle && reachable
      )
    );
  }

  for (const gpu of attached) {
    const name = gpuTitle(gpu, attached, trans);
    const args = { kernelId, uuid: gpu.uuid };
    detaching.push(
      command(CommandIds.detach, args, trans.__('Detach %1', name), idle)
    );
    forcing.push(
      command(
        CommandIds.forceDetach,
        args,
        trans.__('Force-detach %1…', name),
        idle
      )
    );
  }
  if (attached.length > 1) {
    detaching.push(
      command(
        CommandIds.detachAll,
        { kernelId },
        trans.__('Detach all %1 GPUs', attached.length),
        idle
      )
    );
  }
  // Kubernetes mode keeps no CUDA state (its agent refuses `keep`): not offered.
  if (attached.length > 0 && reply?.mode !== 'kubernetes') {
    detaching.push(
      command(
        CommandIds.releaseKeep,
        { kernelId },
        trans.__("Release all, keep the kernel's state"),
        idle
      )
    );
  }
  other.push(
    command(CommandIds.openPanel, {}, trans.__('Open the GPU panel'), true)
  );
  const entries: IMenuEntry[] = [];
  for (const group of groups.filter(g => g.length > 0)) {
    if (entries.length > 0) {
      entries.push({ type: 'separator' });
    }
    entries.push(...group);
  }
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

/**
 * The toolbar item's text: idle "GPU · 2 free", "GPU", "GPU ×2" with GPUs,
 * "GPU · suspended" while the kernel's CUDA state waits in host memory for its
 * next attach, "queued #1" while first in the queue, "attaching…", "detaching…".
 */
export function buttonLabel(
  state: IKernelGpus | null,
  trans: TranslationBundle
): string {
  const queued = queuedLabel(state, trans);
  if (queued !== null) {
    return queued;
  }
  if (state?.operation?.kind === 'attach') {
    return trans.__('attaching…');
  }
  if (state?.operation?.kind === 'detach') {
    return trans.__('detaching…');
  }
  if (isUnreachable(state)) {
    return trans.__('GPU ✕');
  }
  const count = state?.reply?.attached.length ?? 0;
  const suspended = keptState(state);
  if (suspended !== null) {
    return suspended.state === 'suspending'
      ? trans.__('GPU · suspending…')
      : trans.__('GPU · suspended');
  }
  if (count === 0) {
    return state?.reply
      ? trans.__('GPU · %1 free', state.reply.free)
      : trans.__('GPU');
  }
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
  const suspended = keptState(state);
  if (suspended !== null) {
    return trans.__(
      'GPUs: none attached to this notebook, %1 free. %2',
      free,
      suspendedLine(suspended, trans)
    );
  }
  return count === 0
    ? trans.__('GPUs: none attached to this notebook, %1 free', free)
    : trans._n(
        'GPUs: %1 attached to this notebook, %2 free',
        'GPUs: %1 attached to this notebook, %2 free',
        count,
        free
      );
}
