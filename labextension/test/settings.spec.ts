import { readSettings } from '../src/settings';
import { settings } from './fixtures';

describe('readSettings', () => {
  it("takes the registry's composite as it is", () => {
    expect(readSettings({ ...settings })).toEqual(settings);
  });

  it('reports a value of the wrong type instead of guessing', () => {
    expect(() => readSettings({ ...settings, stream: 'yes' })).toThrow(
      'GPU hot-plug setting "stream" should be a boolean, not "yes"'
    );
  });
});
