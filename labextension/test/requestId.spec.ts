import { newRequestId } from '../src/requestId';

describe('newRequestId', () => {
  it('needs no crypto.randomUUID (absent outside secure contexts)', () => {
    // A hub over plain http at a cluster address: browsers leave randomUUID out.
    const own = Object.getOwnPropertyDescriptor(crypto, 'randomUUID');
    Object.defineProperty(crypto, 'randomUUID', {
      value: undefined,
      configurable: true
    });
    try {
      const id = newRequestId();
      // What the server's and the agent's REQUEST_ID_RE accept.
      expect(id).toMatch(/^lab-[0-9a-f]{32}$/);
      expect(newRequestId()).not.toBe(id);
    } finally {
      if (own) {
        Object.defineProperty(crypto, 'randomUUID', own);
      } else {
        delete (crypto as { randomUUID?: unknown }).randomUUID;
      }
    }
  });
});
