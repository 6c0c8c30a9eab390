/**
 * The commands behind every action (menu items, palette, panel buttons,
 * settable shortcuts) and what the user is told about them: confirmation
 * dialogs, notifications of progress, success (with the CUDA hint) and errors
 * (the server's message). Every notification names the notebook it concerns;
 * a "no free GPU" error offers to wait, and goes away once a GPU frees up or
 * the next action starts; GPUs a notebook loses without a detach of this page
 * (a kernel restart, the agent's idle release) are announced.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { Kernel } from '@jupyterlab/services';
import { TranslationBundle } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';
import {
  ReadonlyJSONValue,
  ReadonlyPartialJSONObject
} from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';

import { Classes, CommandIds } from './constants';
import { cudaAlreadyInitialised } from './cuda';
import { gpuName, keptState, suspendedLine } from './format';
import { AttachCancelled, GpuModel, IOperation, IReleased } from './gpuModel';
import { describeError } from './handler';
import { waitingMessage } from './menu';
import { IBusyProcess, IErrorBody, ReleaseReason } from './types';

/** What the commands need from the application. */
export interface ICommandContext {
  commands: CommandRegistry;
  model: GpuModel;
  trans: TranslationBundle;
  /** The kernel of the notebook in focus. */
  currentKernel(): string | null;
  /** The connection to a kernel, to ask it about CUDA. */
  kernelConnection(kernelId: string): Kernel.IKernelConnection | null;
  /** The name of the kernel's notebook ("train.ipynb"), for notifications. */
  notebookName(kernelId: string): string;
  openPanel(): void;
  /** Open (or show) the GPU panel in the main area. */
  openMainArea(): void;
  /** Open the current notebook's GPU menu; `false` if there is none. */
  openMenu(): boolean;
}

/** Register every command; returns nothing, the registry owns them. */
export function addCommands(ctx: ICommandContext): void {
  const { commands, trans } = ctx;
  const notes = new StaleNotes(ctx.model);
  ctx.model.released.connect((_, released) => announceRelease(ctx, released));
  const kernelOf = (args: ReadonlyPartialJSONObject): string | null =>
    typeof args.kernelId === 'string' && args.kernelId !== ''
      ? args.kernelId
      : ctx.currentKernel();
  const enabled = (args: ReadonlyPartialJSONObject) =>
    args.enabled !== false && kernelOf(args) !== null;

  commands.addCommand(CommandIds.attach, {
    label: args =>
      (args.label as string) ?? trans.__('Attach GPUs to this notebook'),
    caption: trans.__("Attach GPUs to the notebook's kernel"),
    isEnabled: enabled,
    execute: args => attach(ctx, notes, kernelOf(args), args)
  });
  commands.addCommand(CommandIds.detach, {
    label: args => (args.label as string) ?? trans.__('Detach a GPU'),
    isEnabled: args => enabled(args) && typeof args.uuid === 'string',
    execute: args => detach(ctx, notes, kernelOf(args), args.uuid as string)
  });
  commands.addCommand(CommandIds.detachAll, {
    label: args =>
      (args.label as string) ?? trans.__('Detach all GPUs of this notebook'),
    isEnabled: enabled,
    execute: args => detach(ctx, notes, kernelOf(args), null)
  });
  commands.addCommand(CommandIds.forceDetach, {
    label: args =>
      (args.label as string) ??
      trans.__('Force-detach all GPUs of this notebook…'),
    className: Classes.destructive,
    isEnabled: enabled,
    execute: args =>
      forceDetach(
        ctx,
        kernelOf(args),
        typeof args.uuid === 'string' ? args.uuid : null,
        busyProcesses(args.processes)
      )
  });
  commands.addCommand(CommandIds.releaseKeep, {
    label: args =>
      (args.label as string) ??
      trans.__("Release all GPUs of this notebook, keep the kernel's state"),
    caption: trans.__(
      "Suspend the kernel's CUDA state into host memory and release its GPUs; the next attach resumes it"
    ),
    isEnabled: enabled,
    execute: args => releaseKeep(ctx, notes, kernelOf(args))
  });
  commands.addCommand(CommandIds.cancelWait, {
    label: args =>
      (args.label as string) ?? trans.__('Stop waiting for a free GPU'),
    isEnabled: args =>
      enabled(args) &&
      (typeof args.requestId === 'string' ||
        ctx.model.state(kernelOf(args))?.operation?.waiting === true),
    execute: args =>
      cancelWait(
        ctx,
        kernelOf(args),
        typeof args.requestId === 'string' ? args.requestId : undefined
      )
  });
  commands.addCommand(CommandIds.openPanel, {
    label: args => (args.label as string) ?? trans.__('Open the GPU panel'),
    execute: () => ctx.openPanel()
  });
  commands.addCommand(CommandIds.openMain, {
    label: args =>
      (args.label as string) ?? trans.__('Open the GPU panel in the main area'),
    execute: () => ctx.openMainArea()
  });
  commands.addCommand(CommandIds.openMenu, {
    label: trans.__("Open this notebook's GPU menu"),
    execute: () => {
      ctx.openMenu();
    }
  });
}

/** How long a progress notification shows before it turns into its outcome. */
const MIN_SHOWN_MS = 400;

/**
 * A progress notification that later becomes its outcome. The outcome waits
 * until the progress has been on screen for `MIN_SHOWN_MS`: JupyterLab draws
 * notifications asynchronously, and an update that arrives before the first
 * drawing is lost (a fast error left "Attaching…" on screen); it also spares
 * the user a flicker.
 */
class ProgressNote {
  constructor(message: string) {
    this._id = Notification.emit(message, 'in-progress', { autoClose: false });
  }

  /** Show `options` (after the first drawing; updates keep their order). */
  finish(
    options: Omit<Notification.IOptions<ReadonlyJSONValue>, 'id'> & {
      message: string;
      type: Notification.TypeOptions;
    }
  ): Promise<void> {
    this._shown = this._shown.then(async () => {
      const left = this._since + MIN_SHOWN_MS - Date.now();
      if (left > 0) {
        await new Promise(resolve => setTimeout(resolve, left));
      }
      Notification.update({ id: this._id, actions: [], ...options });
    });
    return this._shown;
  }

  /** The notification's id (to dismiss it later). */
  get id(): string {
    return this._id;
  }

  private readonly _id: string;
  private _shown: Promise<void> = Promise.resolve();
  private readonly _since = Date.now();
}

function noKernel(trans: TranslationBundle): void {
  Notification.warning(
    trans.__('Open a notebook with a running kernel to manage its GPUs.'),
    { autoClose: 5000 }
  );
}

/** The processes a command's arguments carry (a `busy` error's), checked. */
export function busyProcesses(value: unknown): IBusyProcess[] | null {
  if (!Array.isArray(value)) {
    return null;
  }
  return value.filter(
    (item): item is IBusyProcess =>
      typeof item === 'object' &&
      item !== null &&
      typeof (item as IBusyProcess).pid === 'number' &&
      typeof (item as IBusyProcess).command === 'string'
  );
}

/**
 * Error notes that a later state makes stale: a "no free GPU" error once a GPU
 * is free, a refused detach once its GPUs are gone (its Force-detach would
 * only fail), any error once the next action on that kernel starts.
 */
class StaleNotes {
  constructor(private readonly _model: GpuModel) {
    _model.changed.connect((_, kernelId) => this._check(kernelId));
  }

  /**
   * Dismiss note `id` of `kernelId` when it goes stale; `gpus`: the GPUs a
   * refused detach named (the note goes once none of them is attached).
   */
  add(
    kernelId: string,
    id: string,
    body: IErrorBody,
    gpus: readonly string[] = []
  ): void {
    const free = this._model.state(kernelId)?.reply?.free ?? 0;
    const list = this._notes.get(kernelId) ?? [];
    list.push({
      id,
      untilFree: body.error === 'insufficient_gpus',
      free,
      gpus
    });
    this._notes.set(kernelId, list);
  }

  private _check(kernelId: string): void {
    const list = this._notes.get(kernelId);
    const state = this._model.state(kernelId);
    if (list === undefined || state === null) {
      return;
    }
    const free = state.reply?.free ?? 0;
    const attached = new Set((state.reply?.attached ?? []).map(g => g.uuid));
    const kept = list.filter(note => {
      const gone =
        state.reply !== null &&
        note.gpus.length > 0 &&
        !note.gpus.some(uuid => attached.has(uuid));
      const stale =
        state.operation !== null ||
        (note.untilFree && free > note.free) ||
        gone;
      if (stale) {
        Notification.dismiss(note.id);
      }
      return !stale;
    });
    this._notes.set(kernelId, kept);
  }

  private readonly _notes = new Map<
    string,
    { id: string; untilFree: boolean; free: number; gpus: readonly string[] }[]
  >();
}

/**
 * "GPU 1 was released from train.ipynb…" for GPUs lost without our detach,
 * with the reason the server saw (one notification per reason): the kernel
 * restarted, the agent's idle policy, another page, or the magic or the
 * command line.
 */
function announceRelease(ctx: ICommandContext, released: IReleased): void {
  const { trans } = ctx;
  const notebook = ctx.notebookName(released.kernelId);
  const byReason = new Map<ReleaseReason | null, string[]>();
  for (const gpu of released.gpus) {
    const reason = released.reasons.get(gpu.uuid) ?? null;
    byReason.set(reason, [
      ...(byReason.get(reason) ?? []),
      gpuName(gpu.index, trans)
    ]);
  }
  for (const [reason, gpus] of byReason) {
    const names = gpus.join(', ');
    let message: string;
    switch (reason) {
      case 'kernel_restarted':
        message = trans.__(
          '%1 released from %2: the kernel restarted (a new kernel starts without GPUs).',
          names,
          notebook
        );
        break;
      case 'idle':
        message = trans.__(
          '%1 released from %2: it sat unused, and the GPU service took it back.',
          names,
          notebook
        );
        break;
      case 'detached_here':
        message = trans.__(
          '%1 detached from %2 (in another tab or window).',
          names,
          notebook
        );
        break;
      case 'detached_elsewhere':
        message = trans.__(
          '%1 detached from %2 by %gpu detach in the notebook or on the command line.',
          names,
          notebook
        );
        break;
      default:
        message = trans.__(
          '%1 released from %2 (the kernel restarted or the GPU sat unused).',
          names,
          notebook
        );
    }
    Notification.info(message, { autoClose: 8000 });
  }
}

async function attach(
  ctx: ICommandContext,
  notes: StaleNotes,
  kernelId: string | null,
  args: ReadonlyPartialJSONObject
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  // A GPU card's Attach names its GPU (`uuid`): that one, not any free one.
  const uuid = typeof args.uuid === 'string' ? args.uuid : null;
  const count =
    uuid !== null
      ? 1
      : typeof args.count === 'number'
        ? args.count
        : model.settings.defaultCount;
  const wait = args.wait === true;
  const notebook = ctx.notebookName(kernelId);
  const named =
    uuid === null
      ? null
      : model.state(kernelId)?.reply?.node?.find(gpu => gpu.uuid === uuid);
  const note = new ProgressNote(
    uuid === null
      ? trans._n(
          'Attaching %1 GPU to %2…',
          'Attaching %1 GPUs to %2…',
          count,
          notebook
        )
      : trans.__(
          'Attaching %1 to %2…',
          named ? gpuName(named.index, trans) : uuid,
          notebook
        )
  );
  // Each new place in the queue updates the note; it offers to stop waiting.
  let shown: IOperation | null = null;
  const onChanged = (_: GpuModel, changed: string) => {
    const operation = model.state(kernelId)?.operation ?? null;
    if (
      changed !== kernelId ||
      !operation?.waiting ||
      (shown?.position === operation.position && shown?.of === operation.of)
    ) {
      return;
    }
    shown = operation;
    void note.finish({
      message: wait
        ? `${notebook}: ${waitingMessage(operation, trans)}`
        : trans.__('%1: still attaching…', notebook),
      type: 'in-progress',
      actions: wait
        ? [
            {
              label: trans.__('Cancel'),
              caption: trans.__('Stop waiting for a free GPU'),
              callback: event => {
                // Keep the note: it turns into the outcome.
                event.preventDefault();
                void cancelWait(ctx, kernelId);
              }
            }
          ]
        : []
    });
  };
  model.changed.connect(onChanged);
  const pending = model.attach(
    kernelId,
    count,
    wait ? model.settings.waitSeconds : undefined,
    uuid === null ? [] : [uuid]
  );
  try {
    const reply = await pending;
    const gpus = reply.attachments
      .map(gpu => `${gpuName(gpu.index, trans)} (${gpu.device})`)
      .join(', ');
    let message = trans.__('Attached %1 to %2.', gpus, notebook);
    const kernel = ctx.kernelConnection(kernelId);
    const cuda = kernel === null ? null : await cudaAlreadyInitialised(kernel);
    if (cuda === true) {
      message +=
        ' ' +
        trans.__(
          'CUDA is already initialised in this kernel, so it will not see the new GPU: start a new process (e.g. !python train.py) or restart the kernel and attach before importing torch/jax/cupy.'
        );
    }
    await note.finish({
      message,
      type: cuda === true ? 'warning' : 'success',
      autoClose: cuda === true ? false : 6000
    });
  } catch (error) {
    if (error instanceof AttachCancelled) {
      await note.finish({
        message: trans.__('%1: stopped waiting for a free GPU.', notebook),
        type: 'info',
        autoClose: 5000
      });
      return;
    }
    const body = describeError(error);
    // Not retryable: waiting cannot help (a named GPU the notebook has already).
    const offerWait =
      body.error === 'insufficient_gpus' && !wait && body.retryable !== false;
    await note.finish({
      message: `${notebook}: ${body.message}`,
      type: 'error',
      autoClose: false,
      actions: offerWait
        ? [
            {
              label:
                uuid === null
                  ? trans.__('Wait for a free GPU')
                  : trans.__('Wait for this GPU'),
              caption: trans.__(
                'Wait in the queue (up to %1 s) and attach when one is free',
                model.settings.waitSeconds
              ),
              callback: () =>
                void ctx.commands.execute(CommandIds.attach, {
                  kernelId,
                  count,
                  wait: true,
                  ...(uuid === null ? {} : { uuid })
                })
            }
          ]
        : []
    });
    notes.add(kernelId, note.id, body);
  } finally {
    model.changed.disconnect(onChanged);
  }
}

/** Take the kernel's waiting attach out of the queue; the attach's note says the rest. */
async function cancelWait(
  ctx: ICommandContext,
  kernelId: string | null,
  requestId?: string
): Promise<void> {
  if (kernelId === null) {
    return noKernel(ctx.trans);
  }
  try {
    await ctx.model.cancel(kernelId, requestId);
  } catch (error) {
    Notification.error(describeError(error).message, { autoClose: 8000 });
  }
}

async function detach(
  ctx: ICommandContext,
  notes: StaleNotes,
  kernelId: string | null,
  uuid: string | null
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  const what = describeGpus(ctx, kernelId, uuid);
  if (
    model.settings.confirmDetach &&
    !(await confirm(
      trans.__('Detach %1?', what),
      trans.__(
        'Programs in %2 lose access to %1. Processes still using it keep it busy and the detach is refused.',
        what,
        ctx.notebookName(kernelId)
      ),
      trans.__('Detach'),
      trans
    ))
  ) {
    return;
  }
  const named = uuid === null || uuid === '' ? null : uuid;
  const gpus = (model.state(kernelId)?.reply?.attached ?? [])
    .map(gpu => gpu.uuid)
    .filter(candidate => named === null || candidate === named);
  await runDetach(ctx, notes, kernelId, gpus, uuid, 'detach', what, body =>
    body.error === 'busy'
      ? [
          {
            label: trans.__('Force-detach…'),
            caption: trans.__('End the processes using it, then detach'),
            displayType: 'warn',
            callback: () =>
              void ctx.commands.execute(CommandIds.forceDetach, {
                kernelId,
                uuid: uuid ?? '',
                processes: (body.processes ?? []).map(process => ({
                  pid: process.pid,
                  command: process.command
                }))
              })
          }
        ]
      : []
  );
}

async function forceDetach(
  ctx: ICommandContext,
  kernelId: string | null,
  uuid: string | null,
  processes: IBusyProcess[] | null
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  const what = describeGpus(ctx, kernelId, uuid);
  const attached = model.state(kernelId)?.reply?.attached ?? [];
  const named = uuid === null || uuid === '' ? null : uuid;
  if (
    model.state(kernelId)?.reply != null &&
    !attached.some(gpu => named === null || gpu.uuid === named)
  ) {
    // A late click on an old notification: nothing left to force.
    Notification.info(
      trans.__(
        '%1 is no longer attached to %2: nothing to detach.',
        what,
        ctx.notebookName(kernelId)
      ),
      { autoClose: 5000 }
    );
    return;
  }
  const ending = processes ?? knownProcesses(model, kernelId, uuid);
  if (
    !(await confirm(
      trans.__('Force-detach %1?', what),
      processList(ending, trans),
      trans.__('End processes and detach'),
      trans,
      { focusCancel: true }
    ))
  ) {
    return;
  }
  await runDetach(ctx, null, kernelId, [], uuid, 'force', what, () => []);
}

/**
 * Release every GPU of the kernel and keep its CUDA state (issue 39): the
 * agent suspends the kernel's CUDA processes into host memory first, and the
 * next attach resumes them. A refusal (no checkpoint API, a process that
 * cannot be suspended) changes nothing and offers no force: its words are the
 * agent's.
 */
async function releaseKeep(
  ctx: ICommandContext,
  notes: StaleNotes,
  kernelId: string | null
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  if (
    model.settings.confirmDetach &&
    !(await confirm(
      trans.__(
        'Release all GPUs of %1 and keep its state?',
        ctx.notebookName(kernelId)
      ),
      trans.__(
        'The kernel keeps running. Its CUDA processes are suspended: their state (models, tensors) moves to host memory and the GPUs go back to the node. Attaching resumes them, on GPUs of the same model. Where the driver or a process cannot be suspended, nothing changes.'
      ),
      trans.__('Release'),
      trans
    ))
  ) {
    return;
  }
  const gpus = (model.state(kernelId)?.reply?.attached ?? []).map(
    gpu => gpu.uuid
  );
  const what = trans.__('all GPUs');
  await runDetach(ctx, notes, kernelId, gpus, null, 'keep', what, () => []);
}

/**
 * A cancel / warn dialog; whether the user accepted. `focusCancel`: Cancel has
 * the focus, so an Enter pressed out of habit ends no process.
 */
async function confirm(
  title: string,
  body: string | Widget,
  accept: string,
  trans: TranslationBundle,
  { focusCancel = false }: { focusCancel?: boolean } = {}
): Promise<boolean> {
  const answer = await showDialog({
    title,
    body,
    buttons: [
      Dialog.cancelButton({ label: trans.__('Cancel') }),
      Dialog.warnButton({ label: accept })
    ],
    defaultButton: focusCancel ? 0 : 1
  });
  return answer.button.accept;
}

/** Detach with a notification of progress, then of success or of the server's error. */
async function runDetach(
  ctx: ICommandContext,
  notes: StaleNotes | null,
  kernelId: string,
  gpus: readonly string[],
  uuid: string | null,
  how: 'detach' | 'force' | 'keep',
  what: string,
  actionsFor: (body: IErrorBody) => Notification.IAction[]
): Promise<void> {
  const { model, trans } = ctx;
  const notebook = ctx.notebookName(kernelId);
  const note = new ProgressNote(
    how === 'keep'
      ? trans.__('Releasing %1 of %2, keeping its state…', what, notebook)
      : trans.__('Detaching %1 from %2…', what, notebook)
  );
  try {
    await model.detach(kernelId, uuid, how === 'force', how === 'keep');
    await note.finish({
      message:
        how === 'keep'
          ? await keptMessage(ctx, kernelId, what, notebook)
          : how === 'force'
            ? trans.__('Force-detached %1 from %2.', what, notebook)
            : trans.__('Detached %1 from %2.', what, notebook),
      type: 'success',
      autoClose: 5000
    });
  } catch (error) {
    const body = describeError(error);
    await note.finish({
      message: `${notebook}: ${body.message}`,
      type: 'error',
      autoClose: false,
      actions: actionsFor(body)
    });
    notes?.add(kernelId, note.id, body, gpus);
  }
}

/**
 * What a release with keep did, as the server now shows the kernel: suspended,
 * or nothing to keep (no process used the GPUs: the agent detached them).
 */
async function keptMessage(
  ctx: ICommandContext,
  kernelId: string,
  what: string,
  notebook: string
): Promise<string> {
  const { model, trans } = ctx;
  await model.refresh(kernelId);
  const kept = keptState(model.state(kernelId));
  return kept === null
    ? trans.__(
        'Released %1 of %2: no process used them, so there was no CUDA state to keep.',
        what,
        notebook
      )
    : trans.__(
        'Released %1 of %2. %3',
        what,
        notebook,
        suspendedLine(kept, trans)
      );
}

/** "GPU 1" (the node's numbering) or "all GPUs", as the last reading names it. */
function describeGpus(
  ctx: ICommandContext,
  kernelId: string,
  uuid: string | null
): string {
  if (uuid === null || uuid === '') {
    return ctx.trans.__('all GPUs');
  }
  const attached = ctx.model.state(kernelId)?.reply?.attached ?? [];
  const gpu = attached.find(candidate => candidate.uuid === uuid);
  return gpu === undefined ? uuid : gpuName(gpu.index, ctx.trans);
}

/** The processes the last reading saw on the GPU(s). */
function knownProcesses(
  model: GpuModel,
  kernelId: string,
  uuid: string | null
): IBusyProcess[] {
  const gpus = model.state(kernelId)?.reply?.attached ?? [];
  return gpus
    .filter(gpu => uuid === null || uuid === '' || gpu.uuid === uuid)
    .flatMap(gpu => gpu.metrics?.processes ?? [])
    .map(p => ({ pid: p.pid, command: p.name ?? '?' }));
}

/** The confirmation's body: the processes that will be ended. */
function processList(
  processes: IBusyProcess[],
  trans: TranslationBundle
): Widget {
  const body = new Widget();
  body.addClass(Classes.dialog);
  const intro = document.createElement('p');
  const list = document.createElement('ul');
  if (processes.length === 0) {
    intro.textContent = trans.__(
      'No process is known to use it now; any process that does will be ended.'
    );
  } else {
    intro.textContent = trans._n(
      'This process will be ended:',
      'These %1 processes will be ended:',
      processes.length
    );
    for (const process of processes) {
      const item = document.createElement('li');
      item.textContent = `${process.pid} ${process.command}`;
      list.appendChild(item);
    }
  }
  body.node.append(intro, list);
  return body;
}
