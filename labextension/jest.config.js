/**
 * Unit tests of the frontend's logic (model, stream client, menu rules) in
 * jsdom. JupyterLab's own packages ship ES modules that jest cannot load
 * without transforming half of node_modules, and the logic under test needs
 * only `ServerConnection`, `URLExt`, notifications and dialogs of them, so
 * those are replaced by small mocks (`test/mocks/`); Lumino's packages load
 * as they are.
 */
module.exports = {
  testEnvironment: 'jsdom',
  roots: ['<rootDir>/test'],
  testMatch: ['**/*.spec.ts'],
  setupFiles: ['<rootDir>/test/setup.ts'],
  transform: {
    '^.+\\.ts$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  },
  moduleNameMapper: {
    '^@jupyterlab/apputils$': '<rootDir>/test/mocks/apputils.ts',
    '^@jupyterlab/services$': '<rootDir>/test/mocks/services.ts',
    '^@jupyterlab/coreutils$': '<rootDir>/test/mocks/coreutils.ts'
  }
};
