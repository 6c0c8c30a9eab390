import { ServerConnection } from '@jupyterlab/services';

import { AttachCancelled, GpuModel, ISample } from '../src/gpuModel';
import { IGpuSettings } from '../src/settings';
import { ApiError, describeError } from '../src/handler';
import { IStreamHandlers } from '../src/stream';
import { gpu, node, reply, response, settings as base } from './fixtures';

const makeRequest = ServerConnection.makeRequest as jest.Mock;

function setUp(settings: Partial<IGpuSettings> = {}, history = false) {
  const streams = new Map<string, IStreamHandlers>();
  const disposed: string[] = [];
  let clock = 0;
  let ids = 0;
  const model = new GpuModel({
    settings: { ...base, ...settings },
    now: () => (clock += 1000),
    newRequestId: () => `lab-${++ids}`,
    history,
    openStream: (kernelId, handlers) => {
      streams.set(kernelId, handlers);
      return {
        isDisposed: false,
        dispose: () => disposed.push(kernelId)
      };
    }
  });
  const changes: string[] = [];
  model.changed.connect((_, kernelId) => changes.push(kernelId));
  return { model, streams, disposed, changes };
}

beforeEach(() => {
  makeRequest.mockReset();
  makeRequest.mockResolvedValue(response(200, reply([])));
});

describe('GpuModel', () => {
  it('opens one stream per kernel however many views watch it', () => {
    const { model, streams, disposed } = setUp();
    const a = model.watch('k1');
    const b = model.watch('k1');
    model.watch('k2');
    expect([...streams.keys()]).toEqual(['k1', 'k2']);

    a.dispose();
    a.dispose();
    expect(disposed).toEqual([]);
    b.dispose();
    expect(disposed).toEqual(['k1']);
    expect(model.state('k1')).toBeNull();
    expect(model.state('k2')?.connection).toBe('connecting');
  });

  it('keeps an hour of chart history per node GPU, following hot-plug', () => {
    const { model, streams } = setUp();
    model.watch('k1');
    const stream = streams.get('k1')!;
    // One reading a second (the fake clock) for 61 minutes.
    for (let second = 0; second < 3660; second++) {
      stream.metrics(
        reply([gpu(0)], { node: [node(0, true, second % 100), node(1)] })
      );
    }
    const history = model.state('k1')!.history.get('GPU-0')!;
    expect(history).toHaveLength(3601);
    expect(history[3600].utilization).toBe(59);
    expect(history[3600].memoryUsed).toBe(8 * 1024 ** 3);
    expect(model.state('k1')!.history.get('GPU-1')).toHaveLength(3601);

    stream.metrics(reply([gpu(1, 50)], { node: [node(1, true)] })); // GPU 0 gone
    expect([...model.state('k1')!.history.keys()]).toEqual(['GPU-1']);
  });

  it("starts from the server's history, the same for every page (issue 36)", async () => {
    const { model, streams } = setUp({}, true);
    makeRequest.mockResolvedValueOnce(
      response(200, {
        seconds: 3600,
        columns: [],
        gpus: {
          'GPU-0': [[1, 7, 2, 100, 200]], // an older server: no traffic
          'GPU-1': [[1, 7, 2, 100, 200, 10, 20, 30, null]]
        }
      })
    );
    model.watch('k1');
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(makeRequest.mock.calls[0][0]).toContain('gpu-hotplug/api/history');
    streams
      .get('k1')!
      .metrics(reply([gpu(0)], { node: [node(0, true, 30), node(1)] }));
    const history = model.state('k1')!.history.get('GPU-0')!;
    expect(history.map(s => [s.time, s.utilization])).toEqual([
      [1000, 7],
      [expect.any(Number), 30]
    ]);
    const traffic = (s: ISample) => [
      s.pcieTx,
      s.pcieRx,
      s.nvlinkTx,
      s.nvlinkRx
    ];
    expect(traffic(history[0])).toEqual([null, null, null, null]);
    const linked = model.state('k1')!.history.get('GPU-1')!;
    expect(traffic(linked[0])).toEqual([10, 20, 30, null]);
  });

  it('announces GPUs the kernel lost without a detach of its own', async () => {
    const { model, streams } = setUp();
    model.watch('k1');
    const released: string[][] = [];
    model.released.connect((_, r) => released.push(r.gpus.map(g => g.uuid)));
    const stream = streams.get('k1')!;
    stream.metrics(reply([gpu(0), gpu(1)]));
    makeRequest.mockResolvedValueOnce(response(204, null));
    await model.detach('k1', 'GPU-0');
    stream.metrics(reply([gpu(1)])); // ours: not announced
    expect(released).toEqual([]);
    stream.metrics(reply([])); // the agent's idle release, a restart
    expect(released).toEqual([['GPU-1']]);
  });

  it('announces a loss after a detach of its own was refused', async () => {
    const { model, streams } = setUp();
    model.watch('k1');
    const released: string[][] = [];
    model.released.connect((_, r) => released.push(r.gpus.map(g => g.uuid)));
    const stream = streams.get('k1')!;
    stream.metrics(reply([gpu(0)]));
    makeRequest.mockResolvedValueOnce(
      response(409, { error: 'busy', message: 'in use', retryable: false })
    );
    await expect(model.detach('k1', 'GPU-0')).rejects.toBeDefined();
    stream.metrics(reply([])); // then %gpu detach --force in the notebook
    expect(released).toEqual([['GPU-0']]);
  });

  it('records stream errors until the next good reading', () => {
    const { model, streams } = setUp();
    model.watch('k1');
    const stream = streams.get('k1')!;
    stream.error({
      error: 'agent_unavailable',
      message: 'No GPU agent',
      retryable: true,
      status: 503
    });
    expect(model.state('k1')!.error?.message).toBe('No GPU agent');
    stream.metrics(reply([]));
    expect(model.state('k1')!.error).toBeNull();
  });

  it('attaches through the API and shows the operation meanwhile', async () => {
    const { model, streams } = setUp();
    model.watch('k1');
    makeRequest.mockResolvedValueOnce(
      response(201, { request_id: 'r', kernel_id: 'k1', attachments: [gpu(0)] })
    );
    const pending = model.attach('k1', 2, 30);
    const operation = model.state('k1')!.operation!;
    expect(operation).toMatchObject({
      kind: 'attach',
      count: 2,
      waiting: false
    });

    streams.get('k1')!.progress({
      request_id: operation.requestId!,
      kernel_id: 'k1',
      state: 'waiting',
      count: 2,
      elapsed: 1
    });
    expect(model.state('k1')!.operation!.waiting).toBe(true);

    const done = await pending;
    expect(done.attachments[0].device).toBe('/dev/nvidia0');
    expect(model.state('k1')!.operation).toBeNull();
    const [url, init] = makeRequest.mock.calls[0];
    expect(url).toBe('http://localhost:8888/base/gpu-hotplug/api/attach');
    expect(init.method).toBe('POST');
    expect(JSON.parse(init.body)).toEqual({
      count: 2,
      kernel_id: 'k1',
      request_id: 'lab-1',
      wait_seconds: 30
    });
    // The stream is not open yet: it asks at once, without the cache buster
    // our API rejects.
    expect(makeRequest.mock.calls[1][0]).toBe(
      'http://localhost:8888/base/gpu-hotplug/api/gpus?kernel_id=k1'
    );
    expect(makeRequest.mock.calls[1][1].cache).toBe('no-cache');
  });

  it('asks for no extra reading after an action while the stream is open', async () => {
    const { model, streams } = setUp();
    model.watch('k1');
    streams.get('k1')!.connection('open');
    makeRequest.mockResolvedValueOnce(
      response(201, { request_id: 'r', kernel_id: 'k1', attachments: [gpu(0)] })
    );
    await model.attach('k1', 1);
    expect(makeRequest.mock.calls).toHaveLength(1);
  });

  it('follows the place in the queue and cancels the waiting attach', async () => {
    const { model, streams, changes } = setUp();
    model.watch('k1');
    let answer: (value: Response) => void = () => undefined;
    makeRequest.mockReturnValueOnce(
      new Promise<Response>(resolve => (answer = resolve))
    );
    const pending = model.attach('k1', 1, 60).catch(e => e);
    const requestId = model.state('k1')!.operation!.requestId!;
    const waiting = (position: number, of: number) =>
      streams.get('k1')!.progress({
        request_id: requestId,
        kernel_id: 'k1',
        state: 'waiting',
        count: 1,
        elapsed: 1,
        position,
        of
      });
    waiting(2, 3);
    expect(model.state('k1')!.operation).toMatchObject({
      waiting: true,
      position: 2,
      of: 3
    });
    const before = changes.length;
    waiting(2, 3); // the same place: no change for the views
    expect(changes.length).toBe(before);
    waiting(1, 2);
    expect(model.state('k1')!.operation).toMatchObject({ position: 1, of: 2 });

    makeRequest.mockResolvedValueOnce(response(204, null));
    await model.cancel('k1');
    const [url, init] = makeRequest.mock.calls[1];
    expect(url).toBe('http://localhost:8888/base/gpu-hotplug/api/cancel');
    expect(JSON.parse(init.body)).toEqual({
      request_id: requestId,
      kernel_id: 'k1'
    });

    const refused = {
      error: 'insufficient_gpus',
      message: 'cancelled',
      retryable: true
    };
    answer(response(409, refused));
    const outcome = await pending;
    expect(outcome).toBeInstanceOf(AttachCancelled);
    expect(outcome.requestId).toBe(requestId);
    expect(model.state('k1')!.operation).toBeNull();
    const calls = makeRequest.mock.calls.length;
    await model.cancel('k1'); // nothing waits: no request
    expect(makeRequest.mock.calls.length).toBe(calls);
  });

  it('rejects with the server error body (a busy GPU lists its processes)', async () => {
    const { model } = setUp();
    model.watch('k1');
    const busy = {
      error: 'busy',
      message: 'GPU-0 is in use by 1 process',
      retryable: false,
      processes: [{ pid: 77, command: 'python train.py' }]
    };
    makeRequest.mockResolvedValueOnce(response(409, busy));
    const error = await model.detach('k1', 'GPU-0').catch(e => e);

    expect(error).toBeInstanceOf(ApiError);
    expect(describeError(error)).toEqual({ ...busy, status: 409 });
    const [, init] = makeRequest.mock.calls[0];
    expect(JSON.parse(init.body)).toEqual({
      uuid: 'GPU-0',
      force: false,
      kernel_id: 'k1'
    });
  });

  it('turns a network failure into a message, never a stack', () => {
    const error = new ServerConnection.NetworkError(
      new TypeError('Failed to fetch')
    );
    expect(describeError(error)).toEqual({
      error: 'network_error',
      message: 'The Jupyter server cannot be reached: Failed to fetch',
      retryable: true
    });
  });

  it('without the stream reads the GPUs once per watch and after actions', async () => {
    const { model, streams } = setUp({ stream: false });
    makeRequest.mockResolvedValue(response(200, reply([gpu(0)])));
    model.watch('k1');
    await new Promise(resolve => setTimeout(resolve, 0));
    expect(streams.size).toBe(0);
    expect(model.state('k1')!.connection).toBe('off');
    expect(model.state('k1')!.reply!.attached).toHaveLength(1);

    model.settings = { ...base, stream: true };
    expect([...streams.keys()]).toEqual(['k1']);
  });

  it('closes its streams while paused (page hidden) and reopens them after', () => {
    const { model, streams, disposed } = setUp();
    model.watch('k1');
    const first = streams.get('k1');
    model.paused = true;
    expect(disposed).toEqual(['k1']);
    expect(model.state('k1')!.connection).toBe('paused');
    model.paused = false;
    expect(streams.get('k1')).not.toBe(first);
    expect(model.state('k1')!.connection).toBe('connecting');
  });

  it('announces the current kernel', () => {
    const { model } = setUp();
    const seen: (string | null)[] = [];
    model.currentChanged.connect((_, k) => seen.push(k));
    model.current = 'k1';
    model.current = 'k1';
    model.current = null;
    expect(seen).toEqual(['k1', null]);
  });
});
