import { Notification } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { CommandRegistry } from '@lumino/commands';

import { addCommands, busyProcesses } from '../src/commands';
import { CommandIds } from '../src/constants';
import { GpuModel } from '../src/gpuModel';
import { IStreamHandlers } from '../src/stream';
import { gpu, reply, response, settings, trans } from './fixtures';

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
