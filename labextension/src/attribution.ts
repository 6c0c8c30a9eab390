/**
 * The panel's "by kernel" list under a GPU: which notebook of this server
 * uses how much of it (memory, SM utilisation from NVML's per-process
 * samples), the current notebook highlighted, so a user with several
 * notebooks knows which one to stop. What the server cannot name is one line
 * each: other processes of the server, processes of others (a sum, never a
 * pid), and pids NVML reported in another pid namespace ("unattributed").
 *
 * Kept apart from `panel.ts`: the rows are a pure function of the server's
 * `attribution` (tested without a DOM), and the list is one element a GPU
 * group appends and updates.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { Classes } from './constants';
import { gib, notebookName, percent } from './format';
import { IGpuAttribution, IGpusReply, IUsage } from './types';

const P = `${Classes.panel}-byKernel`;

/** One line of the list. */
export interface IAttributionRow {
  /** Who: a notebook's name, `kernel 1a2b3c4d`, or a group the server cannot name. */
  label: string;
  /** "3.0 GiB · 40 %"; what NVML does not report is left out. */
  usage: string;
  /** The notebook this page shows. */
  current: boolean;
  /** The kernel, for a notebook of this server; `null` for the other lines. */
  kernelId: string | null;
}

/** This GPU's attribution in `reply`, if the server sent one. */
export function attributionOf(
  reply: IGpusReply | null | undefined,
  uuid: string
): IGpuAttribution | null {
  return reply?.attribution?.find(entry => entry.uuid === uuid) ?? null;
}

function usageText(
  memory: number | null,
  util: number | null,
  trans: TranslationBundle
): string {
  const parts: string[] = [];
  if (memory !== null) {
    parts.push(trans.__('%1 GiB', gib(memory)));
  }
  if (util !== null) {
    parts.push(percent(util));
  }
  return parts.join(' · ');
}

function used(usage: IUsage, trans: TranslationBundle): string {
  return usageText(usage.memory_bytes, usage.sm_util_percent, trans);
}

/** The lines of `entry`'s list, kernels first (most memory first). */
export function attributionRows(
  entry: IGpuAttribution | null,
  currentKernelId: string | null,
  trans: TranslationBundle
): IAttributionRow[] {
  if (entry === null) {
    return [];
  }
  const rows: IAttributionRow[] = entry.kernels.map(use => ({
    label: use.notebook
      ? notebookName(use.notebook)
      : trans.__('kernel %1', use.kernel_id.slice(0, 8)),
    usage: used(use, trans),
    current: use.kernel_id === currentKernelId,
    kernelId: use.kernel_id
  }));
  const other = (label: string, usage: string): void => {
    rows.push({ label, usage, current: false, kernelId: null });
  };
  if (entry.server !== null) {
    other(
      trans.__('other processes of this notebook server'),
      used(entry.server, trans)
    );
  }
  if (entry.other_bytes !== null) {
    other(
      trans.__('processes outside this notebook server'),
      usageText(entry.other_bytes, null, trans)
    );
  }
  if (entry.unattributed_processes > 0) {
    other(
      trans.__('unattributed (a process this server cannot see)'),
      usageText(entry.unattributed_bytes, null, trans)
    );
  }
  return rows;
}

/** The list element under one GPU; updated in place, rebuilt only on change. */
export class AttributionList {
  constructor(private readonly _trans: TranslationBundle) {
    this.node = document.createElement('ul');
    this.node.className = P;
    this.node.setAttribute('aria-label', _trans.__('Use of the GPU by kernel'));
    this.node.hidden = true;
  }

  readonly node: HTMLUListElement;

  update(entry: IGpuAttribution | null, currentKernelId: string | null): void {
    const rows = attributionRows(entry, currentKernelId, this._trans);
    const key = JSON.stringify(rows);
    if (key === this._key) {
      return;
    }
    this._key = key;
    this.node.replaceChildren(
      ...rows.map(row => {
        const item = document.createElement('li');
        item.className = `${P}-row`;
        if (row.kernelId !== null) {
          item.dataset.kernelId = row.kernelId;
        }
        if (row.current) {
          item.classList.add(`${P}-current`);
          item.setAttribute('aria-current', 'true');
        }
        const who = document.createElement('span');
        who.className = `${P}-who`;
        who.textContent = row.current
          ? this._trans.__('%1 (this notebook)', row.label)
          : row.label;
        const what = document.createElement('span');
        what.className = `${P}-use`;
        what.textContent = row.usage;
        item.append(who, what);
        return item;
      })
    );
    this.node.hidden = rows.length === 0;
  }

  private _key = '';
}
