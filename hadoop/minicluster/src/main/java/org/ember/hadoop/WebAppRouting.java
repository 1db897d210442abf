/*
 * WebAppRouting - lets the ResourceManager's and the NodeManager's web apps
 * both answer when they share one JVM.
 *
 * Why: Hadoop's web apps are Guice servlet modules, and Hadoop installs
 * Guice's GuiceFilter into Jetty by class name, so every GuiceFilter
 * dispatches through one static FilterPipeline, the one of the injector
 * created last ("Multiple Servlet injectors detected" in the log).  In a
 * MiniYARNCluster the NodeManager starts after the ResourceManager, so the
 * RM's port serves the NM's pages and /ws/v1/cluster/... answers 404 (Flink's
 * YARN tests hit the same).  Each web app keeps its own pipeline, though (the
 * GuiceFilter its injector built, WebApp.guiceFilter.injectedPipeline), so we
 * replace the static one with a pipeline that routes a request by the local
 * port it arrived on.  Test-only surgery through reflection on Guice's
 * classes (found through WebApp's field, so it works whether Guice is
 * relocated by a shaded Hadoop or not); if their layout changes we say so and
 * leave things as they were (the RM REST API then fails loudly in the tests).
 */
package org.ember.hadoop;

import java.lang.reflect.Field;
import java.lang.reflect.InvocationHandler;
import java.lang.reflect.Method;
import java.lang.reflect.Proxy;
import java.util.HashMap;
import java.util.Map;

import org.apache.hadoop.service.Service;
import org.apache.hadoop.yarn.server.MiniYARNCluster;
import org.apache.hadoop.yarn.server.nodemanager.NodeManager;
import org.apache.hadoop.yarn.server.nodemanager.webapp.WebServer;
import org.apache.hadoop.yarn.server.resourcemanager.ResourceManager;
import org.apache.hadoop.yarn.webapp.WebApp;

final class WebAppRouting {
  private WebAppRouting() {}

  /* Installs the port router; returns the RM web app's port. */
  static int install(MiniYARNCluster yarn, int numNodeManagers) throws Exception {
    Map<Integer, Object> byPort = new HashMap<>();
    ResourceManager rm = yarn.getResourceManager();
    Method getWebapp = ResourceManager.class.getDeclaredMethod("getWebapp");
    getWebapp.setAccessible(true);
    WebApp rmApp = (WebApp) getWebapp.invoke(rm);
    int rmPort = rmApp.port();
    byPort.put(rmPort, pipelineOf(rmApp));
    for (int i = 0; i < numNodeManagers; i++) {
      NodeManager nm = yarn.getNodeManager(i);
      for (Service s : nm.getServices()) {
        if (s instanceof WebServer) {
          Field f = WebServer.class.getDeclaredField("webApp");
          f.setAccessible(true);
          WebApp nmApp = (WebApp) f.get(s);
          byPort.put(nmApp.port(), pipelineOf(nmApp));
        }
      }
    }

    Class<?> guiceFilter = WebApp.class.getDeclaredField("guiceFilter").getType();
    Class<?> pipelineType = Class.forName(
        guiceFilter.getPackage().getName() + ".FilterPipeline", true,
        guiceFilter.getClassLoader());
    Field staticPipeline = guiceFilter.getDeclaredField("pipeline");
    staticPipeline.setAccessible(true);
    final Object fallback = staticPipeline.get(null);
    Method d = null;
    for (Method m : pipelineType.getMethods()) {
      if (m.getName().equals("dispatch")) d = m;
    }
    if (d == null) throw new NoSuchMethodException("FilterPipeline.dispatch");
    final Method dispatch = d;
    dispatch.setAccessible(true); // the interface is package-private
    final Method localPort = dispatch.getParameterTypes()[0].getMethod("getLocalPort");
    InvocationHandler h = (proxy, method, args) -> {
      switch (method.getName()) {
        case "dispatch": {
          Object target = byPort.getOrDefault((Integer) localPort.invoke(args[0]), fallback);
          try {
            return dispatch.invoke(target, args);
          } catch (java.lang.reflect.InvocationTargetException e) {
            throw e.getCause();
          }
        }
        case "initPipeline": // each pipeline was initialised when its server started
        case "destroyPipeline": // and is torn down with the JVM
          return null;
        case "toString":
          return "ember port-routing FilterPipeline " + byPort.keySet();
        case "hashCode":
          return System.identityHashCode(proxy);
        case "equals":
          return proxy == args[0];
        default:
          throw new UnsupportedOperationException(method.getName());
      }
    };
    Object router = Proxy.newProxyInstance(guiceFilter.getClassLoader(),
        new Class<?>[] {pipelineType}, h);
    staticPipeline.set(null, router);
    return rmPort;
  }

  private static Object pipelineOf(WebApp app) throws Exception {
    Field gf = WebApp.class.getDeclaredField("guiceFilter");
    gf.setAccessible(true);
    Object filter = gf.get(app);
    if (filter == null) throw new IllegalStateException("web app " + app.name() + " has no GuiceFilter");
    Field ip = gf.getType().getDeclaredField("injectedPipeline");
    ip.setAccessible(true);
    Object p = ip.get(filter);
    if (p == null) throw new IllegalStateException("web app " + app.name() + " has no pipeline");
    return p;
  }
}
