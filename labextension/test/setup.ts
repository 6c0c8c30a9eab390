/**
 * jsdom has no `crypto.randomUUID` (browsers have it in secure contexts); the
 * model makes its request ids with it, so the tests get Node's.
 */
import { webcrypto } from 'crypto';

if (typeof globalThis.crypto?.randomUUID !== 'function') {
  Object.defineProperty(globalThis, 'crypto', {
    value: webcrypto,
    configurable: true
  });
}
