/**
 * jsdom lacks `DragEvent`, which `@lumino/dragdrop` (loaded by
 * `@lumino/widgets`) subclasses at import time; a plain `MouseEvent` subclass
 * is enough for modules that never drag.
 */
if (typeof (globalThis as { DragEvent?: unknown }).DragEvent === 'undefined') {
  (globalThis as { DragEvent?: unknown }).DragEvent = class extends (
    MouseEvent
  ) {};
}
