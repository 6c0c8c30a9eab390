/**
 * The user's settings, read from the setting registry's composite. The
 * defaults live in one place only, `schema/plugin.json`: the registry fills
 * them into `composite`, so nothing here repeats them. A value of the wrong
 * type (a hand-edited file the registry did not validate) is reported, not
 * silently replaced.
 */
import { ReadonlyPartialJSONObject } from '@lumino/coreutils';

/** The settings of `schema/plugin.json`, field for field. */
export interface IGpuSettings {
  /** GPUs the "attach" command asks for when given no count. */
  readonly defaultCount: number;
  /** Ask before detaching. */
  readonly confirmDetach: boolean;
  /** Live updates from the server's stream; off: refresh after actions only. */
  readonly stream: boolean;
  /** The charts' time window at first, in minutes (2–5). */
  readonly chartMinutes: number;
  /** Seconds an attach from "wait for a free GPU" may wait. */
  readonly waitSeconds: number;
}

/**
 * The longest time window the panel offers; the model keeps this much
 * history, and the server keeps as much for every page (`GET history`).
 */
export const MAX_CHART_MINUTES = 60;

/** The time windows the panel offers, in minutes. */
export const CHART_WINDOWS: readonly number[] = [2, 3, 4, 5, 15, 60];

function field<T>(
  composite: ReadonlyPartialJSONObject,
  key: keyof IGpuSettings,
  type: 'number' | 'boolean'
): T {
  const value = composite[key];
  if (typeof value !== type) {
    throw new Error(
      `GPU hot-plug setting "${key}" should be a ${type}, not ${JSON.stringify(value)}`
    );
  }
  return value as T;
}

/** The settings in `composite` (the registry's, schema defaults included). */
export function readSettings(
  composite: ReadonlyPartialJSONObject
): IGpuSettings {
  return {
    defaultCount: field<number>(composite, 'defaultCount', 'number'),
    confirmDetach: field<boolean>(composite, 'confirmDetach', 'boolean'),
    stream: field<boolean>(composite, 'stream', 'boolean'),
    chartMinutes: Math.min(
      MAX_CHART_MINUTES,
      field<number>(composite, 'chartMinutes', 'number')
    ),
    waitSeconds: field<number>(composite, 'waitSeconds', 'number')
  };
}
