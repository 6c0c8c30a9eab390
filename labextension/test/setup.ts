/**
 * What jsdom lacks and the tested modules use:
 *
 * - `DragEvent`, which `@lumino/dragdrop` (loaded by `@lumino/widgets`)
 *   subclasses at import time; a plain `MouseEvent` subclass is enough for
 *   modules that never drag;
 * - Web Crypto where jsdom has none (the model's request ids use
 *   `crypto.getRandomValues`), so the tests get Node's.
 */
import { webcrypto } from 'crypto';

if (typeof (globalThis as { DragEvent?: unknown }).DragEvent === 'undefined') {
  (globalThis as { DragEvent?: unknown }).DragEvent = class extends (
    MouseEvent
  ) {};
}

if (typeof globalThis.crypto?.getRandomValues !== 'function') {
  Object.defineProperty(globalThis, 'crypto', {
    value: webcrypto,
    configurable: true
  });
}
