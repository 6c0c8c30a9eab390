/**
 * The GPU side panel: every GPU of the node with its state (free, this
 * kernel, another kernel or pod, allocated by the scheduler) and live charts
 * of the current kernel's GPUs. It renders the shared `GpuModel` for the
 * current notebook's kernel; GPUs appear and disappear with the readings, so a
 * hot-plug shows without a reload.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { Widget } from '@lumino/widgets';

import { Classes, PANEL_ID } from './constants';
import { renderChart } from './chart';
import { GpuModel, IKernelGpus, isUnreachable, nodeGpus } from './gpuModel';
import { stateLabel } from './holders';

function element<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

const GIB = 1024 ** 3;

export class GpuPanel extends Widget {
  constructor(
    private readonly _model: GpuModel,
    private readonly _trans: TranslationBundle
  ) {
    super();
    this.id = PANEL_ID;
    this.addClass(Classes.panel);
    this.title.caption = _trans.__('GPUs');
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', _trans.__('GPUs'));
    _model.onCurrent(this._render, this);
    this._render();
  }

  private _render(): void {
    const trans = this._trans;
    const state = this._model.state(this._model.current);
    const body = element('div', `${Classes.panel}-body`);
    body.appendChild(element('h2', `${Classes.panel}-title`, trans.__('GPUs')));
    body.appendChild(
      element('p', `${Classes.panel}-summary`, this._summary(state))
    );

    const gpus = nodeGpus(state);
    if (gpus.length > 0) {
      const list = element('ul', `${Classes.panel}-node`);
      list.setAttribute('aria-label', trans.__('GPUs of this node'));
      for (const gpu of gpus) {
        const item = element('li', `${Classes.panel}-gpu`);
        item.dataset.state = gpu.mine ? 'mine' : gpu.state;
        item.dataset.uuid = gpu.uuid;
        item.appendChild(
          element(
            'span',
            `${Classes.panel}-name`,
            `GPU ${gpu.index} · ${gpu.name}`
          )
        );
        item.appendChild(
          element('span', `${Classes.panel}-state`, stateLabel(gpu, trans))
        );
        list.appendChild(item);
      }
      body.appendChild(list);
    }

    for (const gpu of state?.reply?.attached ?? []) {
      const samples = state?.history.get(gpu.uuid) ?? [];
      const last = samples[samples.length - 1];
      const metrics = gpu.metrics;
      const figure = element('figure', `${Classes.panel}-figure`);
      figure.dataset.uuid = gpu.uuid;
      const used = metrics?.memory_used ?? null;
      const total = metrics?.memory_total ?? null;
      const label = trans.__(
        'GPU %1: utilisation %2, memory %3',
        gpu.index,
        last?.utilization === null || last === undefined
          ? trans.__('unknown')
          : `${Math.round(last.utilization)}%`,
        used === null || total === null
          ? trans.__('unknown')
          : `${(used / GIB).toFixed(1)} / ${(total / GIB).toFixed(1)} GiB`
      );
      figure.appendChild(
        renderChart(samples, this._model.settings.chartHistory, label)
      );
      figure.appendChild(
        element('figcaption', `${Classes.panel}-caption`, label)
      );
      body.appendChild(figure);
    }
    this.node.replaceChildren(body);
  }

  private _summary(state: IKernelGpus | null): string {
    const trans = this._trans;
    if (state === null) {
      return trans.__('Open a notebook to see its kernel’s GPUs.');
    }
    if (isUnreachable(state)) {
      return (
        state.error?.message ??
        trans.__('The GPU service cannot be reached; retrying…')
      );
    }
    if (state.reply === null) {
      return state.error?.message ?? trans.__('Loading…');
    }
    const reply = state.reply;
    const simulated = reply.simulated ? ` ${trans.__('(simulated)')}` : '';
    return (
      trans._n(
        'This kernel has %1 GPU; %2 of %3 free on this node.',
        'This kernel has %1 GPUs; %2 of %3 free on this node.',
        reply.attached.length,
        reply.free,
        reply.total
      ) + simulated
    );
  }
}
