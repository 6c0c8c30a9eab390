import { Notification, showDialog } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { CommandRegistry } from '@lumino/commands';

import { addCommands, busyProcesses } from '../src/commands';
import { CommandIds } from '../src/constants';
import { GpuModel } from '../src/gpuModel';
import { IStreamHandlers } from '../src/stream';
import { gpu, reply, response, settings, suspension, trans } from './fixtures';

const makeRequest = ServerConnection.makeRequest as jest.Mock;
const note = Notification as unknown as Record<string, jest.Mock>;

function setUp() {
  const streams = new Map<string, IStreamHandlers>();
  const model = new GpuModel({
    settings,
    newRequestId: () => 'lab-r',
    history: false,
    openStream: (kernelId, handlers) => {
      streams.set(kernelId, handlers);
      return { isDisposed: false, dispose: () => undefined };
    }
  });
  const commands = new CommandRegistry();
  addCommands({
    commands,
    model,
    trans,
    currentKernel: () => 'k1',
    kernelConnection: () => null,
    notebookName: kernelId => (kernelId === 'k1' ? 'train.ipynb' : '?'),
    openPanel: () => undefined,
    openMainArea: () => undefined,
    openMenu: () => true
  });
  model.watch('k1');
  streams.get('k1')!.connection('open');
  return { model, commands, stream: streams.get('k1')! };
}

/** The last options a notification was shown or updated with. */
function lastNote(): { message: string; actions?: Notification.IAction[] } {
  const calls = note.update.mock.calls;
  return calls[calls.length - 1][0];
}

beforeEach(() => {
  makeRequest.mockReset();
  for (const mock of Object.values(note)) {
    mock.mockClear();
  }
});

describe('the attach command', () => {
  it('names the notebook it attached to', async () => {
    const { commands } = setUp();
    makeRequest.mockResolvedValueOnce(
      response(201, { request_id: 'r', kernel_id: 'k1', attachments: [gpu(1)] })
    );
    await commands.execute(CommandIds.attach, { count: 1 });
    expect(note.emit.mock.calls[0][0]).toBe('Attaching 1 GPU to train.ipynb…');
    expect(lastNote().message).toBe(
      'Attached GPU 1 (/dev/nvidia1) to train.ipynb.'
    );
  });

  it('offers to wait when no GPU is free, and the error goes when one frees', async () => {
    const { commands, stream } = setUp();
    stream.metrics(reply([], { free: 0 }));
    makeRequest.mockResolvedValueOnce(
      response(409, {
        error: 'insufficient_gpus',
        message: '1 GPU requested but 0 free',
        retryable: true
      })
    );
    await commands.execute(CommandIds.attach, { count: 1 });
    const refused = lastNote();
    expect(refused.message).toBe('train.ipynb: 1 GPU requested but 0 free');
    expect(refused.actions!.map(a => a.label)).toEqual(['Wait for a free GPU']);

    makeRequest.mockResolvedValueOnce(
      response(201, { request_id: 'r', kernel_id: 'k1', attachments: [gpu(0)] })
    );
    const execute = jest.spyOn(commands, 'execute');
    refused.actions![0].callback(new MouseEvent('click'));
    expect(execute).toHaveBeenCalledWith(CommandIds.attach, {
      kernelId: 'k1',
      count: 1,
      wait: true
    });
    await execute.mock.results[0].value;
    expect(JSON.parse(makeRequest.mock.calls[1][1].body).wait_seconds).toBe(
      settings.waitSeconds
    );
    expect(note.dismiss).toHaveBeenCalledWith('note-1'); // the stale error
  });
});

describe('the release that keeps the kernel (issue 39)', () => {
  const dialog = showDialog as jest.Mock;
  beforeEach(() => {
    dialog.mockReset();
    dialog.mockResolvedValue({ button: { accept: true } });
  });
  afterEach(() => dialog.mockReset());

  it('asks first, and a cancel sends nothing', async () => {
    const { commands, stream } = setUp();
    stream.metrics(reply([gpu(0)], { free: 1 }));
    dialog.mockResolvedValueOnce({ button: { accept: false } });
    await commands.execute(CommandIds.releaseKeep, {});
    expect(dialog.mock.calls[0][0].title).toBe(
      'Release all GPUs of train.ipynb and keep its state?'
    );
    expect(makeRequest).not.toHaveBeenCalled();
  });

  it('asks the server to keep, then says what the agent kept', async () => {
    const { commands, stream } = setUp();
    stream.metrics(reply([gpu(0)], { free: 1 }));
    makeRequest
      .mockResolvedValueOnce(response(204, null))
      .mockResolvedValueOnce(
        response(200, reply([], { free: 2, suspended: suspension() }))
      );
    await commands.execute(CommandIds.releaseKeep, {});
    const sent = JSON.parse(makeRequest.mock.calls[0][1].body);
    expect(sent).toEqual({
      uuid: 'all',
      force: false,
      kernel_id: 'k1',
      keep: true
    });
    expect(note.emit.mock.calls[0][0]).toBe(
      'Releasing all GPUs of train.ipynb, keeping its state…'
    );
    expect(lastNote().message).toBe(
      'Released all GPUs of train.ipynb. ' +
        "This notebook's kernel is suspended (state kept, 3.0 GiB in host memory); " +
        'attaching resumes it on 1 free NVIDIA H100 80GB HBM3 GPU (the same one when free).'
    );
  });

  it('says so when there was no CUDA state to keep', async () => {
    const { commands, stream } = setUp();
    stream.metrics(reply([gpu(0)], { free: 1 }));
    makeRequest
      .mockResolvedValueOnce(response(204, null))
      .mockResolvedValueOnce(response(200, reply([], { free: 2 })));
    await commands.execute(CommandIds.releaseKeep, {});
    expect(lastNote().message).toBe(
      'Released all GPUs of train.ipynb: no process used them, so there was no CUDA state to keep.'
    );
  });

  it("shows the agent's refusal, with no force to offer", async () => {
    const { commands, stream } = setUp();
    stream.metrics(reply([gpu(0)], { free: 1 }));
    makeRequest.mockResolvedValueOnce(
      response(422, {
        error: 'unsupported',
        message: 'the driver lacks the CUDA checkpoint API (R550+)'
      })
    );
    await commands.execute(CommandIds.releaseKeep, {});
    expect(lastNote().message).toBe(
      'train.ipynb: the driver lacks the CUDA checkpoint API (R550+)'
    );
    expect(lastNote().actions).toEqual([]);
  });
});

describe('releases nobody here asked for', () => {
  it('are announced with the notebook they concern', () => {
    const { stream } = setUp();
    stream.metrics(reply([gpu(1)]));
    stream.metrics(reply([]));
    expect(note.info.mock.calls[0][0]).toBe(
      'GPU 1 released from train.ipynb (the kernel restarted or the GPU sat unused).'
    );
  });

  it('say why, as the server saw it (issue 36, item 3)', () => {
    const { stream } = setUp();
    stream.metrics(reply([gpu(0), gpu(1)]));
    const at = 1;
    stream.metrics(
      reply([], {
        released: [
          {
            uuid: gpu(0).uuid,
            index: 0,
            reason: 'detached_elsewhere',
            released_at: at
          },
          { uuid: gpu(1).uuid, index: 1, reason: 'idle', released_at: at }
        ]
      })
    );
    expect(note.info.mock.calls.map(call => call[0])).toEqual([
      'GPU 0 detached from train.ipynb by %gpu detach in the notebook or on the command line.',
      'GPU 1 released from train.ipynb: it sat unused, and the GPU service took it back.'
    ]);
  });
});

describe('busyProcesses', () => {
  it("keeps only well-formed processes from a command's arguments", () => {
    expect(
      busyProcesses([{ pid: 7, command: 'python' }, { pid: 'x' }, null])
    ).toEqual([{ pid: 7, command: 'python' }]);
    expect(busyProcesses('nope')).toBeNull();
  });
});
