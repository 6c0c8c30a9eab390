import { CommandRegistry } from '@lumino/commands';

import { GpuModel } from '../src/gpuModel';
import { attachOffer, GpuPanel, thinned, vitalsText } from '../src/panel';
import { IStreamHandlers } from '../src/stream';
import { IGpuMetrics, INodeGpu } from '../src/types';
import { reply, settings, suspension, trans } from './fixtures';

const metrics = (over: Partial<IGpuMetrics>): IGpuMetrics => ({
  utilization_gpu: 50,
  utilization_memory: 10,
  memory_used: 1,
  memory_total: 2,
  temperature: null,
  power_draw: null,
  power_limit: null,
  processes: [],
  lost: false,
  ...over
});

describe('the panel', () => {
  it('shows temperature and power where NVML gives them (issue 36)', () => {
    expect(
      vitalsText(
        metrics({ temperature: 61, power_draw: 249.6, power_limit: 700 }),
        trans
      )
    ).toBe('61 °C · 250 W of 700 W');
    expect(vitalsText(metrics({ power_draw: 80 }), trans)).toBe('80 W');
    expect(vitalsText(metrics({}), trans)).toBe('');
    expect(vitalsText(null, trans)).toBe('');
  });
});

describe("a free GPU's card", () => {
  const gpu = (selectable?: boolean): INodeGpu => ({
    uuid: 'GPU-00000001-0000-4000-8000-000000000000',
    index: 1,
    minor: 1,
    name: 'NVIDIA H100',
    memory_total: 1,
    state: 'free',
    mine: false,
    ...(selectable === undefined ? {} : { selectable })
  });

  it('offers to attach that GPU where the agent can name it (issue 36)', () => {
    expect(attachOffer(gpu(true), 'local', 'GPU 1', trans)).toEqual({
      offered: true,
      title: 'Attach GPU 1 to this notebook'
    });
  });

  it('says the scheduler picks in Kubernetes, and offers nothing', () => {
    const offer = attachOffer(gpu(false), 'kubernetes', 'GPU 1', trans);
    expect(offer.offered).toBe(false);
    expect(offer.title).toContain("cluster's scheduler picks");
    expect(offer.title).toContain('toolbar');
  });

  it.each(['local', 'kubernetes'] as const)(
    'offers nothing for a GPU in MIG mode in %s mode, and says why',
    mode => {
      const parent: INodeGpu = { ...gpu(false), kind: 'mig_parent' };
      const offer = attachOffer(parent, mode, 'GPU 1', trans);
      expect(offer).toEqual({
        offered: false,
        title:
          'GPU 1 is in MIG mode: it is never attached whole, only as its MIG slices'
      });
    }
  );

  it('offers nothing for a GPU an older server does not call selectable', () => {
    const offer = attachOffer(gpu(), 'local', 'GPU 1', trans);
    expect(offer.offered).toBe(false);
    expect(offer.title).toContain('MIG mode');
  });
});

describe('the chart lines', () => {
  it('draw at most about so many points of a long window, the newest kept', () => {
    const samples = Array.from({ length: 3600 }, (_, i) => ({
      time: i * 1000,
      utilization: i,
      memoryActivity: null,
      memoryUsed: null,
      memoryTotal: null,
      pcieTx: null,
      pcieRx: null,
      nvlinkTx: null,
      nvlinkRx: null
    }));
    const kept = thinned(samples, 720);
    expect(kept.length).toBeLessThanOrEqual(720);
    expect(kept[kept.length - 1].utilization).toBe(3599);
    expect(thinned(samples.slice(0, 10), 720)).toHaveLength(10);
  });
});

describe("the panel of a suspended notebook's kernel (issue 39)", () => {
  it('says the CUDA state waits in host memory, and goes once resumed', () => {
    const streams = new Map<string, IStreamHandlers>();
    const model = new GpuModel({
      settings,
      history: false,
      openStream: (kernelId, handlers) => {
        streams.set(kernelId, handlers);
        return { isDisposed: false, dispose: () => undefined };
      }
    });
    const watch = model.watch('k1');
    model.current = 'k1';
    const panel = new GpuPanel({
      model,
      commands: new CommandRegistry(),
      trans
    });
    const notice = () =>
      panel.node.querySelector<HTMLElement>('.jp-GpuHotplug-panel-suspended')!;

    streams.get('k1')!.metrics(reply([], { suspended: suspension() }));
    expect(notice().hidden).toBe(false);
    expect(notice().getAttribute('role')).toBe('status');
    expect(notice().textContent).toBe(
      "This notebook's kernel is suspended (state kept, 3.0 GiB in host memory); " +
        'attaching resumes it on 1 free NVIDIA H100 80GB HBM3 GPU (the same one when free).'
    );

    streams.get('k1')!.metrics(reply([], { suspended: null }));
    expect(notice().hidden).toBe(true);
    expect(notice().textContent).toBe('');
    panel.dispose();
    watch.dispose();
  });
});
