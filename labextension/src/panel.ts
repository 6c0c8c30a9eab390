/**
 * The GPU panel: every GPU of the node as a group of time charts
 * (utilisation %, memory GiB; traffic: `traffic.ts`) with its state, who holds it and the
 * actions the current notebook may take on it (attach, detach, force-detach);
 * the queue of waiting attaches with their notebooks and countdowns; the
 * notebook kernel's suspended CUDA state (a release with keep); a clear
 * disconnected state. The same widget serves the right side panel and, opened
 * in the main area, a dockable full-size view.
 *
 * It renders the shared `GpuModel` for the current notebook's kernel. GPU
 * groups are kept by UUID and updated in place (not rebuilt every second), so
 * hover tooltips and keyboard focus survive the readings.
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { CommandRegistry } from '@lumino/commands';
import type { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { AttributionList, attributionOf } from './attribution';
import { IChartData, TimeChart } from './chart';
import { Classes, CommandIds } from './constants';
import { chartsCsv, csvFileName } from './csv';
import {
  countdown,
  gib,
  GIB,
  gpuTitle,
  keptState,
  modelName,
  notebookName,
  percent,
  rowState,
  suspendedLine
} from './format';
import {
  GpuModel,
  IKernelGpus,
  ISample,
  isUnreachable,
  nodeGpus
} from './gpuModel';
import { holderLabel, stateLabel } from './holders';
import { CHART_WINDOWS } from './settings';
import { TrafficCharts } from './traffic';
import { IAttachedGpu, IGpuMetrics, INodeGpu, IQueued } from './types';

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

const P = Classes.panel;

/** What a GPU group needs besides its GPU. */
interface IGroupContext {
  state: IKernelGpus;
  attached: readonly IAttachedGpu[];
  disconnected: boolean;
  windowMs: number;
  now: number;
}

/** "61 °C · 250 W of 700 W" (what NVML offers of them; '' for none). */
export function vitalsText(
  metrics: IGpuMetrics | null,
  trans: TranslationBundle
): string {
  const parts: string[] = [];
  if (metrics?.temperature !== null && metrics?.temperature !== undefined) {
    parts.push(trans.__('%1 °C', metrics.temperature));
  }
  const draw = metrics?.power_draw ?? null;
  const limit = metrics?.power_limit ?? null;
  if (draw !== null) {
    parts.push(
      limit === null
        ? trans.__('%1 W', Math.round(draw))
        : trans.__('%1 W of %2 W', Math.round(draw), Math.round(limit))
    );
  }
  return parts.join(' · ');
}

/**
 * What a free GPU's card offers: its own Attach, which names the card's GPU
 * (issue 36: it attached any free one), where the agent can honour a named GPU
 * (`selectable`); elsewhere a disabled one that says why — in Kubernetes the
 * cluster's device plugin picks the GPU, and a GPU in MIG mode (`kind`
 * `mig_parent`, in either mode) goes as slices, never whole.
 */
export function attachOffer(
  gpu: INodeGpu,
  mode: 'local' | 'kubernetes' | undefined,
  name: string,
  trans: TranslationBundle
): { offered: boolean; title: string } {
  if (gpu.selectable === true) {
    return {
      offered: true,
      title: trans.__('Attach %1 to this notebook', name)
    };
  }
  if (gpu.kind === 'mig_parent') {
    return {
      offered: false,
      title: trans.__(
        '%1 is in MIG mode: it is never attached whole, only as its MIG slices',
        name
      )
    };
  }
  return {
    offered: false,
    title:
      mode === 'kubernetes'
        ? trans.__(
            "The cluster's scheduler picks which GPU a notebook gets: use Attach in the toolbar"
          )
        : trans.__(
            '%1 cannot be attached by itself (a GPU in MIG mode is attached as its slices): use Attach in the toolbar',
            name
          )
  };
}

/** Points a chart line draws at most (an hour of readings is 3,600). */
const MAX_POINTS = 720;

/**
 * At most about `max` of `samples`, evenly spaced, the newest kept: a long
 * window's line costs no more to draw than a short one's.
 */
export function thinned(
  samples: readonly ISample[],
  max: number
): readonly ISample[] {
  if (samples.length <= max) {
    return samples;
  }
  const step = Math.ceil(samples.length / max);
  const last = samples.length - 1;
  return samples.filter((_, i) => (last - i) % step === 0);
}

/** One GPU of the node: title, state, actions, and its two charts. */
class GpuGroup {
  constructor(
    private readonly _commands: CommandRegistry,
    private readonly _trans: TranslationBundle,
    uuid: string
  ) {
    const trans = _trans;
    this.node = element('section', `${P}-gpu`);
    this.node.dataset.uuid = uuid;
    const head = element('div', `${P}-gpuHead`);
    this._name = element('h3', `${P}-name`);
    this._state = element('span', `${P}-state`);
    this._actions = element('div', `${P}-actions`);
    const titles = element('div', `${P}-titles`);
    titles.append(this._name, this._state);
    head.append(titles, this._actions);
    // What the widget showed and the panel did not: temperature and power
    // (what nvdashboard users look for), and the notebook's own processes.
    this._vitals = element('p', `${P}-vitals`);
    this._processes = element('ul', `${P}-processes`);
    this._processes.setAttribute(
      'aria-label',
      trans.__('Processes of this notebook on the GPU')
    );
    this._utilization = new TimeChart({
      title: trans.__('Utilisation'),
      unit: '%',
      onHover: time => this._hover(time)
    });
    this._memory = new TimeChart({
      title: trans.__('Memory'),
      unit: 'GiB',
      onHover: time => this._hover(time)
    });
    this._traffic = new TrafficCharts(trans, time => this._hover(time));
    const charts = element('div', `${P}-charts`);
    charts.append(
      this._utilization.node,
      this._memory.node,
      ...this._traffic.charts.map(chart => chart.node)
    );
    this._byKernel = new AttributionList(trans);
    this.node.append(
      head,
      this._vitals,
      this._processes,
      this._byKernel.node,
      charts
    );
    this.node.setAttribute('aria-labelledby', `${P}-name-${uuid}`);
    this._name.id = `${P}-name-${uuid}`;
  }

  readonly node: HTMLElement;

  update(gpu: INodeGpu, samples: readonly ISample[], ctx: IGroupContext): void {
    const trans = this._trans;
    const state = rowState(gpu);
    this.node.dataset.state = state;
    this.node.classList.toggle(Classes.disconnected, ctx.disconnected);
    this._name.textContent = `${gpuTitle(gpu, ctx.attached, trans)} · ${modelName(gpu.name)}`;
    this._name.title = gpu.uuid;
    const label =
      gpu.mine && ctx.state.reply?.kernel_id
        ? trans.__('this notebook')
        : stateLabel(gpu, trans);
    this._state.textContent = ctx.disconnected
      ? trans.__('last known: %1', label)
      : label;
    this._renderActions(gpu, ctx);
    this._renderVitals(gpu);
    const reply = ctx.state.reply;
    this._byKernel.update(
      attributionOf(reply, gpu.uuid),
      reply?.kernel_id ?? null
    );
    samples = thinned(
      samples.filter(s => s.time >= ctx.now - ctx.windowMs),
      MAX_POINTS
    );

    const total = gpu.memory_total || 1;
    const data = (
      series: IChartData['series'],
      yMax: number,
      format: (value: number) => string
    ): IChartData => ({
      series,
      yMax,
      windowMs: ctx.windowMs,
      now: ctx.now,
      format
    });
    this._utilization.update(
      data(
        [
          {
            label: trans.__('GPU busy'),
            kind: 'utilization',
            points: samples.map(s => ({ time: s.time, value: s.utilization }))
          },
          {
            label: trans.__('memory bandwidth'),
            kind: 'activity',
            points: samples.map(s => ({
              time: s.time,
              value: s.memoryActivity
            }))
          }
        ],
        100,
        percent
      )
    );
    this._memory.update(
      data(
        [
          {
            label: trans.__('used'),
            kind: 'memory',
            points: samples.map(s => ({
              time: s.time,
              value: s.memoryUsed === null ? null : s.memoryUsed / GIB
            }))
          },
          {
            label: trans.__('total %1 GiB', gib(total)),
            kind: 'limit',
            points: [ctx.now - ctx.windowMs, ctx.now].map(time => ({
              time,
              value: total / GIB
            }))
          }
        ],
        total / GIB,
        value => `${gib(value * GIB)} GiB`
      )
    );
    this._traffic.update(samples, ctx);
  }

  dispose(): void {
    this._utilization.dispose();
    this._memory.dispose();
    this._traffic.dispose();
    this.node.remove();
  }

  /** Linked tooltips: the time under the pointer in one chart, shown in all. */
  private _hover(time: number | null): void {
    for (const chart of [
      this._utilization,
      this._memory,
      ...this._traffic.charts
    ]) {
      chart.hover(time);
    }
  }

  /** "61 °C · 250 W of 700 W"; under a GPU of this notebook, its processes. */
  private _renderVitals(gpu: INodeGpu): void {
    const trans = this._trans;
    const metrics = gpu.metrics ?? null;
    this._vitals.textContent = vitalsText(metrics, trans);
    this._vitals.hidden = this._vitals.textContent === '';
    const processes = gpu.mine ? (metrics?.processes ?? []) : [];
    const key = processes
      .map(p => `${p.pid}:${p.name}:${p.used_memory}`)
      .join('|');
    if (key !== this._processesKey) {
      this._processesKey = key;
      this._processes.replaceChildren(
        ...processes.map(p =>
          element(
            'li',
            `${P}-process`,
            p.used_memory === null
              ? trans.__('%1 (process %2)', p.name ?? '?', p.pid)
              : trans.__(
                  '%1 (process %2): %3 GiB',
                  p.name ?? '?',
                  p.pid,
                  gib(p.used_memory)
                )
          )
        )
      );
    }
    this._processes.hidden = processes.length === 0;
  }

  private _renderActions(gpu: INodeGpu, ctx: IGroupContext): void {
    const trans = this._trans;
    const kernelId = ctx.state.kernelId;
    const idle = ctx.state.operation === null && !ctx.disconnected;
    const buttons: HTMLButtonElement[] = [];
    const button = (
      text: string,
      title: string,
      command: string,
      args: Record<string, string | number>,
      destructive = false,
      offered = true
    ) => {
      const node = element('button', 'jp-Button jp-mod-small', text);
      node.title = title;
      node.disabled = !idle || !offered;
      if (destructive) {
        node.classList.add(Classes.destructive);
      }
      node.addEventListener('click', () => {
        void this._commands.execute(command, { kernelId, ...args });
      });
      buttons.push(node);
    };
    const name = gpuTitle(gpu, ctx.attached, trans);
    if (gpu.mine) {
      button(
        trans.__('Detach'),
        trans.__('Detach %1 from this notebook', name),
        CommandIds.detach,
        { uuid: gpu.uuid }
      );
      button(
        trans.__('Force-detach…'),
        trans.__('End the processes using %1, then detach it', name),
        CommandIds.forceDetach,
        { uuid: gpu.uuid },
        true
      );
    } else if (gpu.state === 'free') {
      const offer = attachOffer(gpu, ctx.state.reply?.mode, name, trans);
      button(
        trans.__('Attach'),
        offer.title,
        CommandIds.attach,
        { count: 1, uuid: gpu.uuid },
        false,
        offer.offered
      );
    }
    const key = buttons
      .map(b => `${b.textContent}:${b.disabled}:${kernelId}`)
      .join('|');
    if (key !== this._actionsKey) {
      this._actionsKey = key;
      this._actions.replaceChildren(...buttons);
    }
  }

  private readonly _name: HTMLHeadingElement;
  private readonly _state: HTMLSpanElement;
  private readonly _vitals: HTMLParagraphElement;
  private readonly _processes: HTMLUListElement;
  private _processesKey = '';
  private readonly _byKernel: AttributionList;
  private readonly _actions: HTMLDivElement;
  private readonly _utilization: TimeChart;
  private readonly _memory: TimeChart;
  private readonly _traffic: TrafficCharts;
  private _actionsKey = '';
}

export interface IGpuPanelOptions {
  model: GpuModel;
  commands: CommandRegistry;
  trans: TranslationBundle;
  /** Shown in the main area: no "open in main area" button of its own. */
  inMainArea?: boolean;
  now?: () => number;
}

export class GpuPanel extends Widget {
  constructor(options: IGpuPanelOptions) {
    super();
    const trans = options.trans;
    this._model = options.model;
    this._commands = options.commands;
    this._trans = trans;
    this._now = options.now ?? Date.now;
    this._windowMinutes = this._model.settings.chartMinutes;
    this.addClass(Classes.panel);
    this.title.label = options.inMainArea ? trans.__('GPUs') : '';
    this.title.caption = trans.__('GPUs');
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', trans.__('GPUs'));
    // Focusable, so that opening it (Alt+Shift+G, the status bar) moves the
    // keyboard's focus into it rather than leaving it in the notebook.
    this.node.tabIndex = -1;

    const head = element('header', `${P}-head`);
    const titleRow = element('div', `${P}-titleRow`);
    titleRow.appendChild(element('h2', `${P}-title`, trans.__('GPUs')));
    this._badge = element('span', `${P}-badge`, trans.__('SIMULATED'));
    this._badge.hidden = true;
    titleRow.appendChild(this._badge);
    const controls = element('div', `${P}-controls`);
    const windowLabel = element('label', `${P}-window`, trans.__('Show'));
    this._window = element('select', '');
    for (const minutes of CHART_WINDOWS) {
      const option = element('option', '', trans.__('last %1 min', minutes));
      option.value = String(minutes);
      this._window.appendChild(option);
    }
    this._window.value = String(this._windowMinutes);
    this._window.addEventListener('change', () => {
      this._windowMinutes = Number(this._window.value);
      this._render();
    });
    windowLabel.appendChild(this._window);
    controls.appendChild(windowLabel);
    const exportCsv = element(
      'button',
      `jp-Button jp-mod-small ${P}-export`,
      trans.__('CSV')
    );
    exportCsv.title = trans.__(
      "Download the charts' readings of the shown window as CSV"
    );
    exportCsv.setAttribute('aria-label', trans.__('Export the charts as CSV'));
    exportCsv.addEventListener('click', () => this._exportCsv());
    controls.appendChild(exportCsv);
    if (!options.inMainArea) {
      const open = element(
        'button',
        'jp-Button jp-mod-small',
        trans.__('Open in main area')
      );
      open.title = trans.__('Open the GPU panel as a tab of its own');
      open.addEventListener('click', () => {
        void this._commands.execute(CommandIds.openMain);
      });
      controls.appendChild(open);
    }
    titleRow.appendChild(controls);
    this._summary = element('p', `${P}-summary`);
    this._banner = element('div', `${P}-banner`);
    this._banner.setAttribute('role', 'alert');
    this._banner.hidden = true;
    // A live region: a release with keep, and the attach that resumes, are
    // announced where they happen, whichever view started them.
    this._suspended = element('p', `${P}-suspended`);
    this._suspended.setAttribute('role', 'status');
    this._suspended.hidden = true;
    head.append(titleRow, this._summary, this._suspended, this._banner);

    this._queue = element('section', `${P}-queue`);
    this._queue.setAttribute('aria-label', trans.__('Waiting for a GPU'));
    this._groups = element('div', `${P}-gpus`);
    this._groups.setAttribute('aria-label', trans.__('GPUs of this node'));
    this.node.append(head, this._queue, this._groups);

    this._model.onCurrent(this._render, this);
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    for (const group of this._byUuid.values()) {
      group.dispose();
    }
    this._byUuid.clear();
    super.dispose();
  }

  /** What the charts show, as a CSV download. */
  private _exportCsv(): void {
    const state = this._model.state(this._model.current);
    if (state === null) {
      return;
    }
    const now = this._now();
    const text = chartsCsv(
      nodeGpus(state),
      state.history,
      this._windowMinutes * 60_000,
      now
    );
    const link = document.createElement('a');
    link.href = URL.createObjectURL(new Blob([text], { type: 'text/csv' }));
    link.download = csvFileName(now);
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
  }

  private _render(): void {
    const trans = this._trans;
    const state = this._model.state(this._model.current);
    const disconnected = isUnreachable(state);
    this.toggleClass(Classes.disconnected, disconnected);
    this._summary.textContent = this._summaryText(state);
    this._badge.hidden = !state?.reply?.simulated;
    this._banner.hidden = !disconnected;
    this._banner.textContent = disconnected
      ? trans.__(
          'Disconnected from the GPU service: %1 Retrying; the charts stop at the last reading.',
          state?.error?.message ?? ''
        )
      : '';
    const suspended = keptState(state);
    this._suspended.hidden = suspended === null;
    this._suspended.textContent =
      suspended === null ? '' : suspendedLine(suspended, trans);
    this._renderQueue(state);

    const gpus = state === null ? [] : nodeGpus(state);
    const seen = new Set<string>();
    const ctx: IGroupContext | null =
      state === null
        ? null
        : {
            state,
            attached: state.reply?.attached ?? [],
            disconnected,
            windowMs: this._windowMinutes * 60_000,
            now: this._now()
          };
    gpus.forEach((gpu, at) => {
      seen.add(gpu.uuid);
      let group = this._byUuid.get(gpu.uuid);
      if (group === undefined) {
        group = new GpuGroup(this._commands, trans, gpu.uuid);
        this._byUuid.set(gpu.uuid, group);
      }
      if (this._groups.children[at] !== group.node) {
        this._groups.insertBefore(
          group.node,
          this._groups.children[at] ?? null
        );
      }
      group.update(gpu, state?.history.get(gpu.uuid) ?? [], ctx!);
    });
    for (const [uuid, group] of this._byUuid) {
      if (!seen.has(uuid)) {
        group.dispose();
        this._byUuid.delete(uuid);
      }
    }
  }

  private _renderQueue(state: IKernelGpus | null): void {
    const trans = this._trans;
    const queue: readonly IQueued[] = state?.reply?.queue ?? [];
    this._queue.hidden = queue.length === 0;
    if (queue.length === 0) {
      this._queue.replaceChildren();
      return;
    }
    const list = element('ol', `${P}-queueList`);
    const now = this._now();
    for (const entry of queue) {
      const item = element('li', `${P}-queued`);
      item.dataset.requestId = entry.request_id;
      const who =
        entry.held_by === null
          ? trans.__('this pod')
          : entry.held_by.kind === 'notebook'
            ? notebookName(entry.held_by.name)
            : (holderLabel(entry.held_by, trans) ?? '');
      const mine = entry.kernel_id === state?.kernelId;
      const place =
        entry.position === null
          ? trans.__('waiting')
          : trans.__('#%1 of %2', entry.position, entry.of ?? entry.position);
      const whose = mine ? trans.__('%1 (this notebook)', who) : who;
      const text = element(
        'span',
        `${P}-queuedText`,
        entry.deadline === null
          ? trans._n(
              '%2 %3 waits for %1 GPU',
              '%2 %3 waits for %1 GPUs',
              entry.count,
              place,
              whose
            )
          : trans._n(
              '%2 %3 waits for %1 GPU · %4',
              '%2 %3 waits for %1 GPUs · %4',
              entry.count,
              place,
              whose,
              countdown(entry.deadline, now, trans)
            )
      );
      // One queue, whoever started the wait (the toolbar, %gpu attach --wait,
      // the command line): each entry can be stopped here.
      const cancel = element(
        'button',
        'jp-Button jp-mod-small jp-mod-styled',
        trans.__('Cancel')
      );
      cancel.title = trans.__('Stop this wait for a free GPU');
      cancel.setAttribute('aria-label', trans.__('Stop the wait of %1', whose));
      const kernelId = entry.kernel_id;
      cancel.disabled = kernelId === null && state?.kernelId === undefined;
      cancel.addEventListener('click', () => {
        void this._commands.execute(CommandIds.cancelWait, {
          kernelId: kernelId ?? state?.kernelId ?? '',
          requestId: entry.request_id
        });
      });
      item.append(text, cancel);
      if (mine) {
        item.dataset.mine = 'true';
      }
      list.appendChild(item);
    }
    this._queue.replaceChildren(
      element('h3', `${P}-queueTitle`, trans.__('Waiting for a GPU')),
      list
    );
  }

  /** Activated (opened, or shown in the main area): the focus comes here. */
  protected onActivateRequest(msg: Message): void {
    super.onActivateRequest(msg);
    if (this.isAttached && !this.node.contains(document.activeElement)) {
      this.node.focus();
    }
  }

  private _summaryText(state: IKernelGpus | null): string {
    const trans = this._trans;
    if (state === null) {
      return trans.__('Open a notebook to see its GPUs.');
    }
    if (state.reply === null) {
      return state.error?.message ?? trans.__('Loading…');
    }
    const reply = state.reply;
    const mine = reply.attached.map(gpu =>
      gpuTitle(gpu, reply.attached, trans)
    );
    return (
      (mine.length === 0
        ? trans.__('This notebook has no GPU.')
        : trans.__('This notebook has %1.', mine.join(', '))) +
      ' ' +
      trans.__('%1 of %2 free on this node.', reply.free, reply.total)
    );
  }

  private readonly _model: GpuModel;
  private readonly _commands: CommandRegistry;
  private readonly _trans: TranslationBundle;
  private readonly _now: () => number;
  private readonly _summary: HTMLParagraphElement;
  private readonly _badge: HTMLSpanElement;
  private readonly _banner: HTMLDivElement;
  private readonly _suspended: HTMLParagraphElement;
  private readonly _window: HTMLSelectElement;
  private readonly _queue: HTMLElement;
  private readonly _groups: HTMLDivElement;
  private readonly _byUuid = new Map<string, GpuGroup>();
  private _windowMinutes: number;
}
