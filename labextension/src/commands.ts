/**
 * The commands behind every action (menu items, palette, settable shortcuts)
 * and what the user is told about them: confirmation dialogs, notifications of
 * progress, success (with the CUDA hint) and errors (the server's message).
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
import { GpuModel, IOperation } from './gpuModel';
import { describeError } from './handler';
import { waitingMessage } from './menu';
import { IBusyProcess, IErrorBody } from './types';

/** What the commands need from the application. */
export interface ICommandContext {
  commands: CommandRegistry;
  model: GpuModel;
  trans: TranslationBundle;
  /** The kernel of the notebook in focus. */
  currentKernel(): string | null;
  /** The connection to a kernel, to ask it about CUDA. */
  kernelConnection(kernelId: string): Kernel.IKernelConnection | null;
  openPanel(): void;
  /** Open the current notebook's GPU menu; `false` if there is none. */
  openMenu(): boolean;
}

/** Register every command; returns nothing, the registry owns them. */
export function addCommands(ctx: ICommandContext): void {
  const { commands, trans } = ctx;
  const kernelOf = (args: ReadonlyPartialJSONObject): string | null =>
    typeof args.kernelId === 'string' && args.kernelId !== ''
      ? args.kernelId
      : ctx.currentKernel();
  const enabled = (args: ReadonlyPartialJSONObject) =>
    args.enabled !== false && kernelOf(args) !== null;

  commands.addCommand(CommandIds.attach, {
    label: args =>
      (args.label as string) ?? trans.__('Attach GPUs to this kernel'),
    caption: trans.__("Attach GPUs to the notebook's kernel"),
    isEnabled: enabled,
    execute: args => attach(ctx, kernelOf(args), args)
  });
  commands.addCommand(CommandIds.detach, {
    label: args => (args.label as string) ?? trans.__('Detach a GPU'),
    isEnabled: args => enabled(args) && typeof args.uuid === 'string',
    execute: args => detach(ctx, kernelOf(args), args.uuid as string)
  });
  commands.addCommand(CommandIds.detachAll, {
    label: args =>
      (args.label as string) ?? trans.__('Detach all GPUs of this kernel'),
    isEnabled: enabled,
    execute: args => detach(ctx, kernelOf(args), null)
  });
  commands.addCommand(CommandIds.forceDetach, {
    label: args =>
      (args.label as string) ??
      trans.__('Force-detach all GPUs of this kernel…'),
    isEnabled: enabled,
    execute: args =>
      forceDetach(
        ctx,
        kernelOf(args),
        typeof args.uuid === 'string' ? args.uuid : null,
        (args.processes as unknown as IBusyProcess[] | undefined) ?? null
      )
  });
  commands.addCommand(CommandIds.cancelWait, {
    label: args =>
      (args.label as string) ?? trans.__('Stop waiting for a free GPU'),
    isEnabled: args =>
      enabled(args) &&
      ctx.model.state(kernelOf(args))?.operation?.waiting === true,
    execute: args => cancelWait(ctx, kernelOf(args))
  });
  commands.addCommand(CommandIds.openPanel, {
    label: args => (args.label as string) ?? trans.__('Open the GPU panel'),
    execute: () => ctx.openPanel()
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

async function attach(
  ctx: ICommandContext,
  kernelId: string | null,
  args: ReadonlyPartialJSONObject
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  const count =
    typeof args.count === 'number' ? args.count : model.settings.defaultCount;
  const wait = args.wait === true;
  const note = new ProgressNote(
    trans._n('Attaching %1 GPU…', 'Attaching %1 GPUs…', count)
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
        ? waitingMessage(operation, trans)
        : trans.__('Still attaching…'),
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
    wait ? model.settings.waitSeconds : undefined
  );
  const requestId = model.state(kernelId)?.operation?.requestId ?? '';
  try {
    const reply = await pending;
    const devices = reply.attachments.map(gpu => gpu.device).join(', ');
    let message = trans._n(
      'Attached %1 GPU: %2.',
      'Attached %1 GPUs: %2.',
      reply.attachments.length,
      devices
    );
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
    const body = describeError(error);
    const stopped =
      stopping.has(requestId) && body.error === 'insufficient_gpus';
    await note.finish(
      stopped
        ? {
            message: trans.__('Stopped waiting for a free GPU.'),
            type: 'info',
            autoClose: 5000
          }
        : { message: body.message, type: 'error', autoClose: false }
    );
  } finally {
    stopping.delete(requestId);
    model.changed.disconnect(onChanged);
  }
}

/** Attaches the user asked to stop waiting (request ids): their failure is no error. */
const stopping = new Set<string>();

/** Take the kernel's waiting attach out of the queue; the attach's note says the rest. */
async function cancelWait(
  ctx: ICommandContext,
  kernelId: string | null
): Promise<void> {
  if (kernelId === null) {
    return noKernel(ctx.trans);
  }
  const requestId = ctx.model.state(kernelId)?.operation?.requestId;
  if (requestId !== undefined) {
    stopping.add(requestId);
  }
  try {
    await ctx.model.cancel(kernelId);
  } catch (error) {
    if (requestId !== undefined) {
      stopping.delete(requestId);
    }
    Notification.error(describeError(error).message, { autoClose: 8000 });
  }
}

async function detach(
  ctx: ICommandContext,
  kernelId: string | null,
  uuid: string | null
): Promise<void> {
  const { model, trans } = ctx;
  if (kernelId === null) {
    return noKernel(trans);
  }
  const what = gpuName(ctx, kernelId, uuid);
  if (
    model.settings.confirmDetach &&
    !(await confirm(
      trans.__('Detach %1?', what),
      trans.__(
        'Programs in this kernel lose access to %1. Processes still using it keep it busy and the detach is refused.',
        what
      ),
      trans.__('Detach'),
      trans
    ))
  ) {
    return;
  }
  await runDetach(ctx, kernelId, uuid, false, what, body =>
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
                processes: (body.processes ?? []) as unknown as string
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
  const what = gpuName(ctx, kernelId, uuid);
  const ending = processes ?? knownProcesses(model, kernelId, uuid);
  if (
    !(await confirm(
      trans.__('Force-detach %1?', what),
      processList(ending, trans),
      trans.__('End processes and detach'),
      trans
    ))
  ) {
    return;
  }
  await runDetach(ctx, kernelId, uuid, true, what, () => []);
}

/** A cancel / warn dialog; whether the user accepted. */
async function confirm(
  title: string,
  body: string | Widget,
  accept: string,
  trans: TranslationBundle
): Promise<boolean> {
  const answer = await showDialog({
    title,
    body,
    buttons: [
      Dialog.cancelButton({ label: trans.__('Cancel') }),
      Dialog.warnButton({ label: accept })
    ]
  });
  return answer.button.accept;
}

/** Detach with a notification of progress, then of success or of the server's error. */
async function runDetach(
  ctx: ICommandContext,
  kernelId: string,
  uuid: string | null,
  force: boolean,
  what: string,
  actionsFor: (body: IErrorBody) => Notification.IAction[]
): Promise<void> {
  const { model, trans } = ctx;
  const note = new ProgressNote(trans.__('Detaching %1…', what));
  try {
    await model.detach(kernelId, uuid, force);
    await note.finish({
      message: force
        ? trans.__('Detached %1 (forced).', what)
        : trans.__('Detached %1.', what),
      type: 'success',
      autoClose: 5000
    });
  } catch (error) {
    const body = describeError(error);
    await note.finish({
      message: body.message,
      type: 'error',
      autoClose: false,
      actions: actionsFor(body)
    });
  }
}

/** "GPU 0" or "all GPUs", as the last reading names it. */
function gpuName(
  ctx: ICommandContext,
  kernelId: string,
  uuid: string | null
): string {
  if (uuid === null || uuid === '') {
    return ctx.trans.__('all GPUs');
  }
  const gpu = ctx.model
    .state(kernelId)
    ?.reply?.attached.find(candidate => candidate.uuid === uuid);
  return gpu === undefined ? uuid : `GPU ${gpu.index}`;
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
