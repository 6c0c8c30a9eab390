/**
 * How the panel names a GPU's state and who holds it — a module of its own,
 * free of widgets, so that the wording is tested without a DOM.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { IHeldBy, INodeGpu } from './types';

/** Who holds a GPU, in the words the user knows: "team/other.ipynb", "pod ns/name". */
export function holderLabel(
  holder: IHeldBy | null | undefined,
  trans: TranslationBundle
): string | null {
  switch (holder?.kind) {
    case 'notebook':
    case 'kernel':
    case 'process':
      // The path, or the server's words: "kernel <id>", "process N".
      return holder.name;
    case 'pod':
      return trans.__('pod %1', holder.name);
    default:
      return null;
  }
}

/** How the panel names a node GPU's state (and its holder, when another holds it). */
export function stateLabel(gpu: INodeGpu, trans: TranslationBundle): string {
  if (gpu.mine) {
    return trans.__('this notebook');
  }
  const holder = holderLabel(gpu.held_by, trans);
  switch (gpu.state) {
    case 'free':
      return trans.__('free');
    case 'attached':
      return holder === null
        ? trans.__('another kernel or pod')
        : trans.__('held by %1', holder);
    case 'allocated':
      return holder === null
        ? trans.__('allocated by the scheduler')
        : trans.__('allocated by the scheduler to %1', holder);
  }
}
